"""A sequence's top-N log-probs as three flat arrays, for the trips between processes and the answer build.

The engine keeps each sequence's top-N flat while it generates (ids, log-probs, a count per token: no object per
entry) and hands a finished one over as :class:`PackedTop` arrays (:func:`engine_top`). Pickled as per-position
``[(id, log-prob), ...]`` lists, every pair was a tuple, an int and a float to write and to read back: ~3 us per
token to unpickle before any JSON is written. Three arrays (ids, log-probs, entries per position) pickle as
bytes, and the completions writer (``http/wire_json.py``) works on them directly. Short answers stay pair lists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import accumulate, chain
from typing import Any

import numpy as np

from asyncgrpo.server.engine.request import RequestOutput


class PackedTop(Sequence[list[tuple[int, float]]]):
    """Per position ``[(token id, log-prob), ...]`` as flat ``ids`` / ``values`` arrays and per-position ``counts``.

    Reads like the list of lists it packs (``len``, indexing, iteration), so code that wants the pairs still works.
    """

    __slots__ = ("counts", "ids", "values")

    def __init__(self, ids: np.ndarray, values: np.ndarray, counts: np.ndarray) -> None:
        self.ids, self.values, self.counts = ids, values, counts

    @classmethod
    def pack(cls, top: Sequence[Sequence[tuple[int, float]]]) -> PackedTop:
        """Flatten the engine's per-position pairs in C passes (ids stay exact: below 2**53 in a double)."""
        if isinstance(top, PackedTop):
            return top
        counts = np.fromiter(map(len, top), dtype=np.int64, count=len(top))
        flat = np.fromiter(chain.from_iterable(chain.from_iterable(top)), dtype=np.float64, count=2 * int(counts.sum()))
        return cls(flat[0::2].astype(np.int64), flat[1::2].copy(), counts)

    def __len__(self) -> int:
        return len(self.counts)

    def __reduce__(self) -> tuple:
        """Pickled as one byte block (ids as int32, counts as int32, the values in their own dtype): one object to
        write and read back, and the arrays come back as views of it, not copies."""
        values = self.values
        blob = b"".join((self.ids.astype(np.int32).tobytes(), self.counts.astype(np.int32).tobytes(), values.tobytes()))
        return (_unpack, (blob, len(self.ids), len(self.counts), values.dtype.str))

    def _rows(self) -> list[list[tuple[int, float]]]:
        return _pair_rows(self.ids.tolist(), self.values.tolist(), self.counts.tolist())

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return self._rows()[i]
        i = range(len(self))[i]  # negative indices; IndexError past the end
        start, k = int(self.counts[:i].sum()), int(self.counts[i])
        return list(zip(self.ids[start : start + k].tolist(), self.values[start : start + k].tolist()))

    def __iter__(self) -> Any:
        return iter(self._rows())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return [list(map(tuple, r)) for r in self] == [list(map(tuple, r)) for r in other]
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


def _unpack(blob: bytes, entries: int, positions: int, values_dtype: str) -> PackedTop:
    ids = np.frombuffer(blob, dtype=np.int32, count=entries)
    counts = np.frombuffer(blob, dtype=np.int32, count=positions, offset=4 * entries)
    values = np.frombuffer(blob, dtype=np.dtype(values_dtype), count=entries, offset=4 * (entries + positions))
    return PackedTop(ids, values, counts)


PACK_MIN_ENTRIES = 256  # fewer top-N entries pickle as tuples for less than numpy's fixed cost of packing


def packed_output(out: RequestOutput) -> RequestOutput:
    """``out`` with its top-N packed (the form it travels in to another process); unchanged when it has fewer
    than ``PACK_MIN_ENTRIES`` entries (``logprobs=0``, short answers) or is packed already."""
    top = out.top_logprobs
    if top is None or isinstance(top, PackedTop) or sum(map(len, top)) < PACK_MIN_ENTRIES:
        return out
    return dataclasses.replace(out, top_logprobs=PackedTop.pack(out.top_logprobs))


def engine_top(ids: list[int], values: list[float], counts: list[int]) -> PackedTop | list[list[tuple[int, float]]]:
    """A finished sequence's top-N from the engine's flat lists (``counts`` entries per position): packed arrays, or
    per-position pair lists below ``PACK_MIN_ENTRIES`` entries, the form :func:`packed_output` would leave them in."""
    if len(ids) < PACK_MIN_ENTRIES:
        return _pair_rows(ids, values, counts)
    doubles = np.array(values, dtype=np.float64)
    singles = doubles.astype(np.float32)  # the sampler's log-probs are float32 values (wire_json): half the bytes
    kept = singles if np.array_equal(singles, doubles) else doubles  # any other value keeps every bit
    return PackedTop(np.array(ids, dtype=np.int64), kept, np.array(counts, dtype=np.int64))


def _pair_rows(ids: list[int], values: list[float], counts: list[int]) -> list[list[tuple[int, float]]]:
    """Per position ``[(id, log-prob), ...]``: ``counts[i]`` consecutive entries of the flat lists for position i."""
    pairs = list(zip(ids, values))
    ends = list(accumulate(counts))
    return [pairs[e - k : e] for e, k in zip(ends, counts)]

"""An answer's top-N log-probs as arrays (:class:`TopLogprobs`) and the whole-list passes that build them.

A GRPO answer carries ~9 top-N entries per generated token and the rollout worker parses every answer on its one
event loop, so these passes run in C over whole lists (a map, a join, one numpy call) rather than per entry; the
per-entry paths in ``results.py`` read, or name the fault of, anything these refuse.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

NEG_INF_WIRE = -9999.0  # vLLM sends -inf log-probs as this number
TOKEN_KEY = "token_id:"  # top_logprobs keys with return_tokens_as_token_ids
_KEY_LEN = len(TOKEN_KEY)
_SEPARATOR = "," + TOKEN_KEY  # between two keys joined with ","
_POW10 = 10 ** np.arange(1, 19, dtype=np.int64)  # an id >= 10**k has more than k digits


class TopLogprobs(Sequence[dict[int, float]]):
    """Per position the top-N ``{token id: log-prob}``, held as two ``[L, W]`` arrays instead of L dicts.

    A GRPO answer has ~10 of these numbers per generated token; as dicts they are most of what the
    rollout worker holds, pickles and garbage-collects, and the trainer wants arrays anyway. Row ``i``
    holds ``counts[i]`` entries in the answer's order (top-N best first, then the sampled token when
    it is not among them); the rest of the row is padding (id -1, log-prob -inf). Reads like the list
    of dicts it stands for (``len``, indexing, iteration, ``==`` with a list).

    ``sortable`` is True when no entry's log-prob is -inf or NaN (the parser knows it for free): a plain sort
    on the log-probs then keeps each row's padding last, and :meth:`best` needs no padding mask.
    """

    __slots__ = ("counts", "ids", "sortable", "values")

    def __init__(self, ids: np.ndarray, values: np.ndarray, counts: np.ndarray, sortable: bool = False) -> None:
        self.ids, self.values, self.counts, self.sortable = ids, values, counts, sortable

    def __len__(self) -> int:
        return len(self.counts)

    def _row(self, ids: list[int], values: list[float], k: int) -> dict[int, float]:
        return dict(zip(ids[:k], values[:k]))

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        k = int(self.counts[i])
        return self._row(self.ids[i].tolist(), self.values[i].tolist(), k)

    def __iter__(self) -> Iterator[dict[int, float]]:
        return map(self._row, self.ids.tolist(), self.values.tolist(), self.counts.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Sequence) and not isinstance(other, str):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TopLogprobs({list(self)!r})"

    def best(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's ``n`` best entries, best first (ties keep the answer's order): ``[L, n]`` ids and log-probs,
        padded with -1 / -inf where a row has fewer. They may be views of this object's arrays: copy to write."""
        L, W = self.ids.shape
        values = self.values
        if W > 1 and (values[:, :-1] >= values[:, 1:]).all():  # rows already best first (padding -inf sorts last)
            ids, values = self.ids[:, :n], values[:, :n]
        else:
            # One stable sort on -log-prob. Padding (-inf) sorts after every entry unless an entry is -inf or NaN
            # too; then the padding is keyed NaN: NaN sorts after every number, and the stable sort keeps a real
            # NaN entry (earlier in its row) ahead of the padding, as the answer's order has it.
            key = -values
            if not self.sortable:
                key[np.arange(W) >= self.counts[:, None]] = np.nan
            order = np.argsort(key, axis=1, kind="stable")[:, :n]
            order += np.arange(L)[:, None] * W  # flat indices: one gather per array
            ids, values = self.ids.ravel()[order], values.ravel()[order]
        if W < n:
            ids = np.concatenate([ids, np.full((L, n - W), -1, dtype=ids.dtype)], axis=1)
            values = np.concatenate([values, np.full((L, n - W), -np.inf, dtype=values.dtype)], axis=1)
        return ids, values


def _layout(counts: np.ndarray, flat_ids: np.ndarray, flat_values: np.ndarray) -> TopLogprobs:
    """Lay per-position entries (row-major, ``counts`` per position) out as :class:`TopLogprobs`, mapping
    vLLM's -9999.0 to -inf (null came in as NaN)."""
    sortable = bool(flat_values.min(initial=0.0) > NEG_INF_WIRE)  # NaN fails the comparison too
    if not sortable:
        flat_values[flat_values <= NEG_INF_WIRE] = -np.inf
    L = len(counts)
    width = int(counts.max(initial=0))
    if L and int(counts.min()) == width:  # every row full: the flat lists are the rows
        return TopLogprobs(flat_ids.reshape(L, width), flat_values.reshape(L, width), counts, sortable)
    filled = np.arange(width) < counts[:, None]
    ids = np.full((L, width), -1, dtype=np.int64)
    values = np.full((L, width), -np.inf, dtype=np.float64)
    ids[filled] = flat_ids
    values[filled] = flat_values
    return TopLogprobs(ids, values, counts, sortable)


def _has_repeat(counts: np.ndarray, flat_ids: np.ndarray) -> bool:
    """Whether some row names one id twice."""
    width = int(counts.max(initial=0))
    ids = np.full((len(counts), width), -1, dtype=np.int64)
    ids[np.arange(width) < counts[:, None]] = flat_ids
    ordered = np.sort(ids, axis=1)
    return bool(((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any())


def top_arrays(counts: np.ndarray, flat_ids: np.ndarray, flat_values: Any) -> TopLogprobs | None:
    """:class:`TopLogprobs` of per-position entries (row-major, ``counts`` per position); None when a value is not
    a number or a row names one id twice (the per-entry path decides what that means)."""
    try:
        flat_values = np.array(flat_values, dtype=np.float64)
    except (ValueError, TypeError):
        return None
    if flat_ids.shape != (int(counts.sum()),) or flat_values.shape != flat_ids.shape or _has_repeat(counts, flat_ids):
        return None
    return _layout(counts, flat_ids, flat_values)


def _ids_from_text(keys: list[str]) -> np.ndarray | None:
    """The ids of ``token_id:<id>`` keys read from their text in one pass (any spelling ``int`` reads the same
    way), or None when a key is not one."""
    try:
        joined = ",".join(keys)
    except TypeError:
        return None
    if joined.count(TOKEN_KEY) != len(keys):
        return None
    try:
        return np.fromstring(joined.replace(TOKEN_KEY, ""), dtype=np.int64, sep=",")
    except ValueError:
        return None


def _canonical_ids(top_raw: list[dict], n: int) -> np.ndarray | None:
    """The ids of the rows' ``n`` keys when every key is spelled ``token_id:<digits>`` without sign, space or
    leading zero (what vLLM writes); None otherwise.

    One numpy read of the joined keys, with ``,token_id:`` as the separator, then a length check: a read spelling
    other than the canonical one (``+7``, ``07``, `` 7``) is longer than it, so joined keys exactly as long as the
    canonical spellings of the ids read are those spellings, one key per id. Two canonical keys never name one
    id, so these rows need no duplicate check.
    """
    if not n:
        return np.zeros(0, dtype=np.int64)
    try:
        joined = ",".join(chain.from_iterable(top_raw))
    except TypeError:  # a key that is not a str: the per-key path names it
        return None
    if not joined.startswith(TOKEN_KEY):
        return None
    try:
        ids = np.fromstring(joined[_KEY_LEN:], dtype=np.int64, sep=_SEPARATOR)
    except ValueError:  # not read to its end
        return None
    if ids.shape != (n,) or ids.min() < 0:
        return None
    digits = int(np.searchsorted(_POW10, ids, side="right").sum()) + n
    return ids if len(joined) == digits + n * _KEY_LEN + n - 1 else None


def completion_top_arrays(top_raw: list[Any]) -> TopLogprobs | None:
    """:class:`TopLogprobs` of well-formed ``{"token_id:<id>": logprob}`` rows in whole-list passes (C), or None
    for anything unusual (a null row, a key without the prefix, two spellings of one id), which the per-key path
    reads or names."""
    if set(map(type, top_raw)) - {dict}:
        return None
    counts = np.fromiter(map(len, top_raw), dtype=np.int64, count=len(top_raw))
    n = int(counts.sum())
    flat_ids = _canonical_ids(top_raw, n)
    if flat_ids is None:  # an unusual spelling: each key read as int reads it, then a check for repeats
        flat_ids = _ids_from_text(list(chain.from_iterable(top_raw)))
        if flat_ids is None or flat_ids.shape != (n,) or _has_repeat(counts, flat_ids):
            return None
    try:
        flat_values = np.fromiter(chain.from_iterable(map(dict.values, top_raw)), dtype=np.float64, count=n)
    except (TypeError, ValueError):  # a null (read as NaN below), or not a number at all
        try:
            flat_values = np.array(list(chain.from_iterable(map(dict.values, top_raw))), dtype=np.float64)
        except (TypeError, ValueError):
            return None
    return _layout(counts, flat_ids, flat_values)


_get_token_id, _get_logprob = itemgetter("token_id"), itemgetter("logprob")


def generate_top_arrays(content: list[Any]) -> TopLogprobs | None:
    """:class:`TopLogprobs` of ``/inference/v1/generate`` entries (``top_logprobs`` = [sampled, ranked top-N]):
    the sampled token's repeat among the ranked ones is dropped, as the per-entry dicts do. None for anything
    unusual (a missing field, an id that is not an integer), which the per-entry path reads or names."""
    try:
        rows = [e.get("top_logprobs") or [] for e in content]
        flat = list(chain.from_iterable(rows))
        id_list, values = list(map(_get_token_id, flat)), list(map(_get_logprob, flat))
        if not set(map(type, id_list)) <= {int}:
            return None
        ids = np.array(id_list, dtype=np.int64)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
        return None
    counts = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    starts = np.cumsum(counts) - counts
    row = np.repeat(np.arange(len(rows)), counts)
    first_id = np.where(counts > 0, ids[np.minimum(starts, max(len(ids) - 1, 0))], -1) if len(ids) else (
        np.full(len(rows), -1))  # fmt: skip
    later = np.arange(len(ids)) > starts[row]
    repeat = later & (ids == first_id[row])  # the sampled entry again, at its rank
    keep = ~repeat
    return top_arrays(np.bincount(row[keep], minlength=len(rows)).astype(np.int64), ids[keep],
                      np.asarray(values, dtype=object)[keep].tolist())  # fmt: skip

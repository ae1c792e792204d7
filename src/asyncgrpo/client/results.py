"""Parsed answers of the two generation endpoints (``/inference/v1/generate``, ``/v1/completions``).

Both parse into the same :class:`GenerationResult`, so callers do not care which
endpoint served them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter
from typing import Any

import numpy as np

from asyncgrpo.client.errors import ServerError

_NEG_INF_WIRE = -9999.0  # vLLM sends -inf log-probs as this number
_TOKEN_KEY = "token_id:"  # top_logprobs keys with return_tokens_as_token_ids


@dataclass
class VersionSpan:
    """Output tokens ``[start, end)`` came from weights ``version``."""

    version: str
    start: int
    end: int


@dataclass
class GenerationResult:
    """One generated sequence, parsed from either generation endpoint.

    Per-token lists share the length of ``token_ids``. ``logprobs[i]`` is the
    server's processed log-prob of ``token_ids[i]``. ``top_logprobs[i]`` maps
    token id -> log-prob for the requested top-N of that position (the sampled
    token is always present, so N or N+1 entries); None when not returned.
    ``sampling_mask[i]`` lists the token ids that survived top-k/top-p/min-p
    (only ``/inference/v1/generate`` with ``--return-sampling-mask``).
    ``-inf`` log-probs (sent as -9999.0) are returned as ``-inf``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_reason: int | str | None = None
    top_logprobs: Sequence[dict[int, float]] | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[VersionSpan] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    text: str | None = None
    request_id: str | None = None


def _lp(value: float | None) -> float:
    if value is None:
        return math.nan
    return -math.inf if value <= _NEG_INF_WIRE else float(value)


def error_message(body: bytes) -> str:
    """The server's message from vLLM's ``{"error": {"message"}}`` body, FastAPI's ``detail``, or the text."""
    text = body.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:2000] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if isinstance(err, str):
            return err
        for key in ("detail", "message"):
            if key in data:
                return str(data[key])
    return text[:2000]


# The per-token loops below inline the common case (a finite float) and call _lp only for -9999.0, null or an
# int: a GRPO run parses ~10 numbers per generated token here, so a function call per number is most of the cost.


def _lps(values: list[Any]) -> list[float]:
    return [v if type(v) is float and v > _NEG_INF_WIRE else _lp(v) for v in values]


def parse_generate_choice(choice: Mapping[str, Any], request_id: str | None = None) -> GenerationResult:
    """Parse one choice of ``POST /inference/v1/generate``."""
    token_ids = list(map(int, choice.get("token_ids") or []))
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = _lps([e.get("logprob") for e in content])
    top: Sequence[dict[int, float]] | None = None
    if content and any(e.get("top_logprobs") is not None for e in content):
        top = _generate_top_arrays(content)
        if top is None:
            top = [
                {
                    int(t["token_id"]): v if type(v := t["logprob"]) is float and v > _NEG_INF_WIRE else _lp(v)
                    for t in e.get("top_logprobs") or []
                }
                for e in content
            ]
    spans = _spans(choice)
    mask = choice.get("sampling_mask")
    if mask is not None and not set(map(type, chain.from_iterable(mask))) <= {int}:
        mask = [[int(t) for t in row] for row in mask]  # e.g. 5.0 from some writer; JSON integers need no copy
    return GenerationResult(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=str(choice.get("finish_reason")),
        stop_reason=choice.get("stop_reason"),
        top_logprobs=top,
        sampling_mask=mask,
        weight_versions=spans,
        request_id=request_id,
    )


def _token_id_key(key: str) -> int:
    if not key.startswith(_TOKEN_KEY):
        raise ServerError(
            "POST /v1/completions", 200, f"top_logprobs key {key!r} is not 'token_id:<id>' (return_tokens_as_token_ids)"
        )
    return int(key.split(":", 1)[1])


_KEY_LEN = len(_TOKEN_KEY)


def _completion_tops(top_raw: list[Any]) -> list[dict[int, float]]:
    """``top_logprobs`` of a completions choice: ``{"token_id:<id>": logprob}`` dicts -> ``{id: logprob}``."""
    tops = []
    for d in top_raw:
        if not d:
            tops.append({})
            continue
        row = {
            int(k[_KEY_LEN:]): v if type(v) is float and v > _NEG_INF_WIRE else _lp(v)
            for k, v in d.items()
            if k[:_KEY_LEN] == _TOKEN_KEY
        }
        if len(row) != len(d):  # a key without the prefix (or two spellings of one id): name it
            for k in d:
                _token_id_key(k)
            raise ServerError("POST /v1/completions", 200, f"top_logprobs keys {list(d)} name one token id twice")
        tops.append(row)
    return tops


class TopLogprobs(Sequence[dict[int, float]]):
    """Per position the top-N ``{token id: log-prob}``, held as two ``[L, W]`` arrays instead of L dicts.

    A GRPO answer has ~10 of these numbers per generated token; as dicts they are most of what the
    rollout worker holds, pickles and garbage-collects, and the trainer wants arrays anyway. Row ``i``
    holds ``counts[i]`` entries in the answer's order (top-N best first, then the sampled token when
    it is not among them); the rest of the row is padding (id -1, log-prob -inf). Reads like the list
    of dicts it stands for (``len``, indexing, iteration, ``==`` with a list).
    """

    __slots__ = ("counts", "ids", "values")

    def __init__(self, ids: np.ndarray, values: np.ndarray, counts: np.ndarray) -> None:
        self.ids, self.values, self.counts = ids, values, counts

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
        padded with -1 / -inf where a row has fewer."""
        L, W = self.ids.shape
        padding = np.arange(W) >= self.counts[:, None]  # after every real entry, whatever its value (even NaN)
        order = np.lexsort((-self.values, padding), axis=1)[:, :n]  # stable: ties keep the answer's order
        ids = np.take_along_axis(self.ids, order, axis=1)
        values = np.take_along_axis(self.values, order, axis=1)
        if W < n:
            ids = np.concatenate([ids, np.full((L, n - W), -1, dtype=ids.dtype)], axis=1)
            values = np.concatenate([values, np.full((L, n - W), -np.inf, dtype=values.dtype)], axis=1)
        return ids, values


def _top_arrays(counts: np.ndarray, flat_ids: np.ndarray, flat_values: Any) -> TopLogprobs | None:
    """Lay per-position entries (row-major, ``counts`` per position) out as :class:`TopLogprobs`; None when a
    row names one id twice (the per-entry path decides what that means)."""
    try:
        flat_values = np.array(flat_values, dtype=np.float64)
    except (ValueError, TypeError):
        return None
    if flat_ids.shape != (int(counts.sum()),) or flat_values.shape != flat_ids.shape:
        return None
    flat_values[flat_values <= _NEG_INF_WIRE] = -np.inf  # vLLM's -inf; null came in as NaN
    width = int(counts.max(initial=0))
    filled = np.arange(width) < counts[:, None]
    ids = np.full((len(counts), width), -1, dtype=np.int64)
    values = np.full((len(counts), width), -np.inf, dtype=np.float64)
    ids[filled] = flat_ids
    ordered = np.sort(ids, axis=1)
    if ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)).any():
        return None
    values[filled] = flat_values
    return TopLogprobs(ids, values, counts)


def _completion_top_arrays(top_raw: list[Any]) -> TopLogprobs | None:
    """:class:`TopLogprobs` of well-formed ``{"token_id:<id>": logprob}`` rows in whole-list passes (C), or None
    for anything unusual (a null row, a key without the prefix, two spellings of one id), which the per-key path
    reads or names."""
    if not all(type(d) is dict for d in top_raw):
        return None
    counts = np.fromiter(map(len, top_raw), dtype=np.int64, count=len(top_raw))
    keys = list(chain.from_iterable(top_raw))
    joined = ",".join(keys)
    if joined.count(_TOKEN_KEY) != len(keys):
        return None
    try:
        flat_ids = np.fromstring(joined.replace(_TOKEN_KEY, ""), dtype=np.int64, sep=",") if keys else (
            np.zeros(0, dtype=np.int64))  # fmt: skip
    except ValueError:
        return None
    return _top_arrays(counts, flat_ids, list(chain.from_iterable(map(dict.values, top_raw))))


def _generate_top_arrays(content: list[Any]) -> TopLogprobs | None:
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
    return _top_arrays(np.bincount(row[keep], minlength=len(rows)).astype(np.int64), ids[keep],
                       np.asarray(values, dtype=object)[keep].tolist())  # fmt: skip


_get_token_id, _get_logprob = itemgetter("token_id"), itemgetter("logprob")


def _spans(choice: Mapping[str, Any]) -> list[VersionSpan]:
    """``weight_versions`` (null on vLLM's completions unless ``return_weight_versions`` was sent)."""
    return [VersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in choice.get("weight_versions") or []]


def parse_completion_choice(choice: Mapping[str, Any], request_id: str | None = None) -> GenerationResult:
    """Parse one choice of ``POST /v1/completions`` sent with ``return_tokens_as_token_ids``."""
    lp = choice.get("logprobs") or {}
    token_ids = choice.get("token_ids")
    if token_ids is None:  # a server that ignores return_token_ids: recover ids from the token strings
        token_ids = [_token_id_key(t) for t in lp.get("tokens") or []]
    top_raw = lp.get("top_logprobs")
    top: Sequence[dict[int, float]] | None = None
    if top_raw is not None:
        arrays = _completion_top_arrays(top_raw)
        top = arrays if arrays is not None else _completion_tops(top_raw)
    return GenerationResult(
        token_ids=list(map(int, token_ids)),
        logprobs=_lps(lp.get("token_logprobs") or []),
        finish_reason=str(choice.get("finish_reason")),
        stop_reason=choice.get("stop_reason"),
        top_logprobs=top,
        prompt_token_ids=choice.get("prompt_token_ids"),
        text=choice.get("text"),
        request_id=request_id,
        weight_versions=_spans(choice),
    )

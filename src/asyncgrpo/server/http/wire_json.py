"""JSON text of the per-token parts of the generation answers, built without per-token dicts.

A GRPO run asks for ``logprobs=N`` (top-N per position) on every token. Building vLLM's answer as
nested dicts (one dict per position, one per top entry) and then encoding it costs tens of
microseconds per token in the server process, whose event loop shares the GIL with the engine
thread; at tens of thousands of tokens per second that is most of a core taken from generation.
Here each position is one ``%`` format of a cached template. The text decodes to exactly the JSON
the dict path produces, so the wire format stays vLLM 0.33's.

Numbers: the engine computes log-probs in float32. When every value of an answer is a float32 value
(always, for the engine's answers) it is written with the fewest digits that read back as the same
float32 (orjson's float32 writer; without orjson, and in answers shorter than ``SMALL_ANSWER`` positions,
9 significant digits, which also read back exactly):
about half the bytes of a double's 17 digits and a quarter of the formatting time. A reader that
keeps doubles sees the decimal's nearest double; converted to float32, as the trainer does, it is the
engine's value bit for bit. Other doubles (not float32) keep 17 significant digits and read back as
the same double.

Requests whose log-probs hold -inf or NaN (rare: masked tokens) take the dict path, which maps
them to vLLM's ``-9999.0`` / ``null``; these functions return None for them.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from array import array
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate, chain
from typing import Any

import numpy as np

from asyncgrpo import json_codec
from asyncgrpo.server.engine.packed_top import PackedTop

TOKEN_KEY = "token_id:"  # vLLM's top_logprobs key with return_tokens_as_token_ids
# 17 significant digits read back as the same double; '#' keeps the decimal point (1.0 stays a float, not 1).
FLOAT = "%#.17g"
FLOAT32 = "%#.9g"  # 9 significant digits read back as the same float32 (FLT_DECIMAL_DIG)
TEXT = "%s"  # a number already written as text (float32_texts)
SMALL_ANSWER = 32  # positions: shorter answers are built by a Python loop (numpy's fixed cost would dominate)
FLOAT_STYLE = "shortest float32 (orjson)" if json_codec.orjson is not None else "9 significant digits (float32)"


def _numbers(values: list[float] | np.ndarray) -> tuple[str, list[Any]] | None:
    """How ``values`` go into a template: its ``%`` slot and the arguments, or None when one is not finite."""
    arr = np.asarray(values, dtype=np.float64)
    if not np.isfinite(arr).all():
        return None
    with np.errstate(over="ignore"):
        f32 = arr.astype(np.float32)
    if not np.array_equal(f32, arr):  # not the engine's float32 values: keep every bit of the doubles
        return FLOAT, arr.tolist()
    texts = json_codec.float32_texts(f32)
    return (FLOAT32, arr.tolist()) if texts is None else (TEXT, texts)


def _numbers_small(values: list[float]) -> tuple[str, list[Any]] | None:
    """:func:`_numbers` for a short answer without numpy's fixed cost: 9 significant digits for float32 values."""
    if not all(map(math.isfinite, values)):
        return None
    try:
        exact = array("f", values).tolist() == values
    except OverflowError:  # beyond float32's range: a double
        exact = False
    return (FLOAT32 if exact else FLOAT), values


@lru_cache(maxsize=256)
def _completion_template(n: int, slot: str) -> str:
    return "{" + ",".join(['"token_id:%d":' + slot] * n) + "}"


@lru_cache(maxsize=256)
def _ranked_template(n: int, slot: str) -> str:
    """A content entry: the sampled token, then ``top_logprobs`` = [sampled, n ranked entries]."""
    entry = '{"token_id":%d,"logprob":' + slot + ',"rank":%d}'
    return "{" + entry[1:-1] + ',"top_logprobs":[' + ",".join([entry] * (n + 1)) + "]}"


def _split(
    logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]] | None
) -> tuple[str, list[Any], list[Any], list[float], list[int]] | None:
    """(slot, sampled log-prob args, top entries as flat ``id, value`` args, the entries' values, entries per
    position), or None when a value is not finite."""
    n = len(logprobs)
    if n < SMALL_ANSWER:
        tops = list(top) if isinstance(top, PackedTop) else top if top is not None else [()] * n
        flat = list(chain.from_iterable(chain.from_iterable(tops)))  # id, value, id, value, ...
        values = flat[1::2]
        small = _numbers_small(list(logprobs) + values)
        if small is None:
            return None
        slot, args = small
        flat[1::2] = args[n:]
        return slot, args[:n], flat, values, list(map(len, tops))
    packed = PackedTop.pack(top if top is not None else [()] * n)
    numbers = _numbers(np.concatenate([np.asarray(logprobs, dtype=np.float64), packed.values]))
    if numbers is None:
        return None
    slot, args = numbers
    flat = [None] * (2 * len(packed.ids))
    flat[0::2], flat[1::2] = packed.ids.tolist(), args[n:]
    return slot, args[:n], flat, packed.values.tolist(), packed.counts.tolist()


def _completion_small(token_ids: Sequence[int], split: tuple[str, list[Any], list[Any], list[float], list[int]]) -> str:
    """The ``top_logprobs`` text of a short answer: one loop over positions (cheaper than numpy's fixed cost)."""
    slot, sampled, flat, _, counts = split
    templates: list[str] = []
    args: list[Any] = []
    pos = 0
    for tok, lp, k in zip(token_ids, sampled, counts):
        entry_args = flat[pos : pos + 2 * k]
        pos += 2 * k
        args += entry_args
        if tok in entry_args[0::2]:
            templates.append(_completion_template(k, slot))
        else:  # the sampled token is always listed (vLLM)
            templates.append(_completion_template(k + 1, slot))
            args += (tok, lp)
    return ",".join(templates) % tuple(args)


def completion_logprobs_json(
    token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]] | None
) -> str | None:
    """``choices[i].logprobs`` of ``/v1/completions`` with ``return_tokens_as_token_ids``, or None (non-finite).

    Same content as the dict path: ``tokens`` are ``"token_id:<id>"``, ``text_offset`` their running
    lengths, each ``top_logprobs`` entry lists the top-N in order and then the sampled token when it
    is not among them. The arguments are laid out with whole-array numpy passes (no loop over
    positions) and go through one format string.
    """
    L = len(token_ids)
    tokens = [TOKEN_KEY + str(t) for t in token_ids]
    offsets = list(accumulate(map(len, tokens[:-1]), initial=0)) if tokens else []
    head = '{"text_offset":' + json.dumps(offsets, separators=(",", ":"))
    middle = '],"tokens":' + json.dumps(tokens, separators=(",", ":")) + ',"top_logprobs":['
    if L < SMALL_ANSWER:
        split = _split(logprobs, top)
        if split is None:
            return None
        slot, sampled_args = split[0], split[1]
        return (head + ',"token_logprobs":[' + ",".join([slot] * L) % tuple(sampled_args) + middle
                + _completion_small(token_ids, split) + "]}")  # fmt: skip
    packed = PackedTop.pack(top if top is not None else [()] * L)
    numbers = _numbers(np.concatenate([np.asarray(logprobs, dtype=np.float64), packed.values]))
    if numbers is None:
        return None
    slot, args = numbers
    sampled, entry_values = np.array(args[:L], dtype=object), np.array(args[L:], dtype=object)
    tok = np.asarray(token_ids, dtype=np.int64)
    counts = packed.counts
    row = np.repeat(np.arange(L), counts)  # the position of each top entry
    extra = np.bincount(row[packed.ids == tok[row]], minlength=L) == 0  # sampled token not listed: append it
    before = np.cumsum(extra) - extra  # appended pairs ahead of each position
    size = len(packed.ids) + int(extra.sum())
    ids_out, values_out = np.empty(size, dtype=object), np.empty(size, dtype=object)
    at = np.arange(len(packed.ids)) + before[row]
    ids_out[at], values_out[at] = packed.ids.astype(object), entry_values
    at = (np.cumsum(counts) + before)[extra]
    ids_out[at], values_out[at] = tok[extra].astype(object), sampled[extra]
    pairs = np.empty(2 * size, dtype=object)
    pairs[0::2], pairs[1::2] = ids_out, values_out
    sizes = (counts + extra).tolist()
    templates = {n: _completion_template(n, slot) for n in set(sizes)}
    return (head + ',"token_logprobs":[' + ",".join([slot] * L) % tuple(sampled.tolist()) + middle
            + ",".join(map(templates.__getitem__, sizes)) % tuple(pairs.tolist()) + "]}")  # fmt: skip


def generate_content_json(
    token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]] | None
) -> str | None:
    """``choices[i].logprobs`` of ``/inference/v1/generate`` (``{"content": [...]}``), or None (non-finite).

    Each entry: the sampled token with its rank, then ``top_logprobs`` = [sampled, ranked top-N].
    The rank of a sampled token outside the top-N counts the better tokens known (exact for greedy).
    """
    split = _split(logprobs, top)
    if split is None:
        return None
    slot, sampled, flat, values, counts = split
    templates: list[str] = []
    args: list[Any] = []
    pos = 0
    for tok, lp, lp_value, k in zip(token_ids, sampled, logprobs, counts):
        ids = flat[2 * pos : 2 * (pos + k) : 2]
        texts = flat[2 * pos + 1 : 2 * (pos + k) : 2]
        if tok in ids:
            rank = ids.index(tok) + 1
        else:
            rank = 1 + sum(1 for v in values[pos : pos + k] if v > lp_value)
        pos += k
        args += (tok, lp, rank, tok, lp, rank)
        args += chain.from_iterable(zip(ids, texts, range(1, k + 1)))
        templates.append(_ranked_template(k, slot))
    return '{"content":[' + ",".join(templates) % tuple(args) + "]}"


class RawJSON:
    """A value :func:`encode_with_raw` writes verbatim (already-encoded JSON text)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def encode_with_raw(data: object) -> bytes:
    """Compact UTF-8 JSON of ``data`` where every :class:`RawJSON` value is spliced in as its text.

    Each RawJSON is first encoded as a placeholder string (a NUL character and a fresh random nonce, so no string
    of the answer can spell it) and replaced in one pass afterwards.
    """
    orjson = json_codec.orjson
    if orjson is not None:  # orjson splices pre-encoded text itself (Fragment) and writes in C

        def fragment(obj: object) -> Any:
            if isinstance(obj, RawJSON):
                return orjson.Fragment(obj.text)
            raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")

        return orjson.dumps(data, default=fragment)
    raws: list[str] = []
    mark = f"\x00raw-json-{uuid.uuid4().hex}:"

    def default(obj: object) -> str:
        if isinstance(obj, RawJSON):
            raws.append(obj.text)
            return f"{mark}{len(raws) - 1}"
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")

    text = json.dumps(data, separators=(",", ":"), default=default)
    if raws:
        quoted = re.compile(re.escape(json.dumps(mark)[:-1]) + r'(\d+)"')
        text = quoted.sub(lambda m: raws[int(m.group(1))], text)
    return text.encode()

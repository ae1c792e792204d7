"""JSON text of the per-token parts of the generation answers, built without per-token dicts.

A GRPO run asks for ``logprobs=N`` (top-N per position) on every token. Building vLLM's answer as
nested dicts (one dict per position, one per top entry) and then encoding it costs tens of
microseconds per token in the server process, whose event loop shares the GIL with the engine
thread; at tens of thousands of tokens per second that is most of a core taken from generation.
Here each position is one ``%`` format of a cached template. The text decodes to exactly the JSON
the dict path produces, so the wire format stays vLLM 0.33's.

Numbers: the engine computes log-probs in float32. When every value of an answer is a float32 value
(always, for the engine's answers) it is written with the fewest digits that read back as the same
float32 (orjson's float32 writer; without orjson, 9 significant digits, which also read back exactly):
about half the bytes of a double's 17 digits and a quarter of the formatting time. A reader that
keeps doubles sees the decimal's nearest double; converted to float32, as the trainer does, it is the
engine's value bit for bit. Other doubles (not float32) keep 17 significant digits and read back as
the same double.

Requests whose log-probs hold -inf or NaN (rare: masked tokens) take the dict path, which maps
them to vLLM's ``-9999.0`` / ``null``; these functions return None for them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate, chain
from operator import itemgetter
from typing import Any

import numpy as np

from asyncgrpo import json_codec

TOKEN_KEY = "token_id:"  # vLLM's top_logprobs key with return_tokens_as_token_ids
# 17 significant digits read back as the same double; '#' keeps the decimal point (1.0 stays a float, not 1).
FLOAT = "%#.17g"
FLOAT32 = "%#.9g"  # 9 significant digits read back as the same float32 (FLT_DECIMAL_DIG)
TEXT = "%s"  # a number already written as text (float32_texts)
FLOAT_STYLE = "shortest float32 (orjson)" if json_codec.orjson is not None else "9 significant digits (float32)"
_first = itemgetter(0)


def _numbers(values: list[float]) -> tuple[str, Sequence[Any]] | None:
    """How ``values`` go into a template: its ``%`` slot and the arguments, or None when one is not finite."""
    arr = np.asarray(values, dtype=np.float64)
    if not np.isfinite(arr).all():
        return None
    with np.errstate(over="ignore"):
        f32 = arr.astype(np.float32)
    if not np.array_equal(f32, arr):  # not the engine's float32 values: keep every bit of the doubles
        return FLOAT, values
    texts = json_codec.float32_texts(f32)
    return (FLOAT32, values) if texts is None else (TEXT, texts)


def float_list_json(values: Sequence[float]) -> str | None:
    """A JSON array of finite floats written as described above, or None when one is not finite."""
    numbers = _numbers(list(values))
    if numbers is None:
        return None
    slot, args = numbers
    return "[" + ",".join([slot] * len(args)) % tuple(args) + "]"


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
) -> tuple[str, Sequence[Any], list[Any], list[int]] | None:
    """(slot, sampled log-prob args, top entries as flat ``id, value`` args, entries per position), or None."""
    tops = top if top is not None else [()] * len(logprobs)
    flat = list(chain.from_iterable(chain.from_iterable(tops)))  # id, value, id, value, ...
    n = len(logprobs)
    numbers = _numbers(list(logprobs) + flat[1::2])
    if numbers is None:
        return None
    slot, args = numbers
    flat[1::2] = args[n:]
    return slot, args[:n], flat, list(map(len, tops))


def completion_logprobs_json(
    token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]] | None
) -> str | None:
    """``choices[i].logprobs`` of ``/v1/completions`` with ``return_tokens_as_token_ids``, or None (non-finite).

    Same content as the dict path: ``tokens`` are ``"token_id:<id>"``, ``text_offset`` their running
    lengths, each ``top_logprobs`` entry lists the top-N in order and then the sampled token when it
    is not among them. One format string and one argument tuple for the whole sequence.
    """
    split = _split(logprobs, top)
    if split is None:
        return None
    slot, sampled, flat, counts = split
    tokens = [TOKEN_KEY + str(t) for t in token_ids]
    offsets = list(accumulate(map(len, tokens[:-1]), initial=0)) if tokens else []
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
    return (
        '{"text_offset":' + json.dumps(offsets, separators=(",", ":"))
        + ',"token_logprobs":[' + ",".join([slot] * len(sampled)) % tuple(sampled)
        + '],"tokens":' + json.dumps(tokens, separators=(",", ":"))
        + ',"top_logprobs":[' + ",".join(templates) % tuple(args) + "]}"
    )  # fmt: skip


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
    slot, sampled, flat, counts = split
    tops = top if top is not None else [()] * len(token_ids)
    templates: list[str] = []
    args: list[Any] = []
    pos = 0
    for tok, lp, lp_value, k, entries in zip(token_ids, sampled, logprobs, counts, tops):
        ids = flat[pos : pos + 2 * k : 2]
        texts = flat[pos + 1 : pos + 2 * k : 2]
        pos += 2 * k
        if tok in ids:
            rank = ids.index(tok) + 1
        else:
            rank = 1 + sum(1 for _, v in entries if v > lp_value)
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

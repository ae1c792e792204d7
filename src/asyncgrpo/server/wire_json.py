"""JSON text of the per-token parts of the generation answers, built without per-token dicts.

A GRPO run asks for ``logprobs=N`` (top-N per position) on every token. Building vLLM's answer as
nested dicts (one dict per position, one per top entry) and then encoding it costs tens of
microseconds per token in the server process, whose event loop shares the GIL with the engine
thread; at tens of thousands of tokens per second that is most of a core taken from generation.
Here each position is one ``%`` format of a cached template, and the lists of plain numbers go
through the C encoder of :mod:`json`. The text is exactly the JSON the dict path produces
(``json.loads`` of both is equal; floats print with 17 significant digits, which read back exactly), so the wire
format stays vLLM 0.33's.

Requests whose log-probs hold -inf or NaN (rare: masked tokens) take the dict path, which maps
them to vLLM's ``-9999.0`` / ``null``; these functions return None for them.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate, chain
from operator import itemgetter
from typing import Any

TOKEN_KEY = "token_id:"  # vLLM's top_logprobs key with return_tokens_as_token_ids
# 17 significant digits read back as the same double; '#' keeps the decimal point (1.0 stays a float, not 1).
# This is about twice as fast as repr's shortest-digits search, which dominates the cost of these answers.
FLOAT = "%#.17g"
_ENTRY = '{"token_id":%d,"logprob":' + FLOAT + ',"rank":%d}'
_second = itemgetter(1)
_first = itemgetter(0)


def _finite(logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]] | None) -> bool:
    """Whether every log-prob prints as a plain JSON number (checked in C: no per-token Python frames)."""
    if not all(map(math.isfinite, logprobs)):
        return False
    return top is None or all(map(math.isfinite, map(_second, chain.from_iterable(top))))


def float_list_json(values: Sequence[float]) -> str:
    """A JSON array of finite floats (see ``FLOAT``)."""
    return "[" + ",".join([FLOAT] * len(values)) % tuple(values) + "]"


@lru_cache(maxsize=64)
def _completion_template(n: int) -> str:
    return "{" + ",".join(['"token_id:%d":' + FLOAT] * n) + "}"


@lru_cache(maxsize=64)
def _ranked_template(n: int) -> str:
    """A content entry: the sampled token, then ``top_logprobs`` = [sampled, n ranked entries]."""
    sampled = _ENTRY[1:-1]
    return "{" + sampled + ',"top_logprobs":[' + ",".join([_ENTRY] * (n + 1)) + "]}"


def completion_logprobs_json(
    token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]] | None
) -> str | None:
    """``choices[i].logprobs`` of ``/v1/completions`` with ``return_tokens_as_token_ids``, or None (non-finite).

    Same content as the dict path: ``tokens`` are ``"token_id:<id>"``, ``text_offset`` their running
    lengths, each ``top_logprobs`` entry lists the top-N in order and then the sampled token when it
    is not among them. One format string and one argument tuple for the whole sequence.
    """
    if not _finite(logprobs, top):
        return None
    tokens = [TOKEN_KEY + str(t) for t in token_ids]
    offsets = list(accumulate(map(len, tokens[:-1]), initial=0)) if tokens else []
    tops = top if top is not None else [()] * len(token_ids)
    templates: list[str] = []
    args: list[Any] = []
    for tok, lp, entries in zip(token_ids, logprobs, tops):
        args += chain.from_iterable(entries)
        if tok in map(_first, entries):
            templates.append(_completion_template(len(entries)))
        else:  # the sampled token is always listed (vLLM)
            templates.append(_completion_template(len(entries) + 1))
            args += (tok, lp)
    return (
        '{"text_offset":' + json.dumps(offsets, separators=(",", ":"))
        + ',"token_logprobs":' + float_list_json(logprobs)
        + ',"tokens":' + json.dumps(tokens, separators=(",", ":"))
        + ',"top_logprobs":[' + ",".join(templates) % tuple(args) + "]}"
    )  # fmt: skip


def generate_content_json(
    token_ids: Sequence[int], logprobs: Sequence[float], top: Sequence[Sequence[tuple[int, float]]] | None
) -> str | None:
    """``choices[i].logprobs`` of ``/inference/v1/generate`` (``{"content": [...]}``), or None (non-finite).

    Each entry: the sampled token with its rank, then ``top_logprobs`` = [sampled, ranked top-N].
    The rank of a sampled token outside the top-N counts the better tokens known (exact for greedy).
    """
    if not _finite(logprobs, top):
        return None
    tops = top if top is not None else [()] * len(token_ids)
    templates: list[str] = []
    args: list[Any] = []
    for tok, lp, entries in zip(token_ids, logprobs, tops):
        ids = list(map(_first, entries))
        if tok in ids:
            rank = ids.index(tok) + 1
        else:
            rank = 1 + sum(1 for v in map(_second, entries) if v > lp)
        args += (tok, lp, rank, tok, lp, rank)
        for r, (t, v) in enumerate(entries, 1):
            args += (t, v, r)
        templates.append(_ranked_template(len(entries)))
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

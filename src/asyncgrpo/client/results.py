"""Parsed answers of the two generation endpoints (``/inference/v1/generate``, ``/v1/completions``).

Both parse into the same :class:`GenerationResult`, so callers do not care which
endpoint served them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import numpy as np

from asyncgrpo import routed_experts
from asyncgrpo.client.top_logprobs import (  # noqa: F401 - TopLogprobs re-exported
    NEG_INF_WIRE,
    TOKEN_KEY,
    TopLogprobs,
    completion_top_arrays,
    generate_top_arrays,
)
from asyncgrpo.errors import ServerError

_NEG_INF_WIRE = NEG_INF_WIRE  # vLLM sends -inf log-probs as this number
_TOKEN_KEY = TOKEN_KEY  # top_logprobs keys with return_tokens_as_token_ids


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
    ``routed_experts`` (servers started with ``--enable-return-routed-experts``): ``[n, layers, top_k]``
    expert ids of prompt + output tokens from the request's ``routed_experts_prompt_start`` on, the last
    output token excluded (``asyncgrpo.routed_experts``); None when the server does not return them.
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
    routed_experts: np.ndarray | None = None


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
        top = generate_top_arrays(content)
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
        routed_experts=_routed(choice, "POST /inference/v1/generate"),
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
        arrays = completion_top_arrays(top_raw)
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
        routed_experts=_routed(choice, "POST /v1/completions"),
    )


def _routed(choice: Mapping[str, Any], endpoint: str) -> np.ndarray | None:
    """The choice's ``routed_experts`` array (None when absent or null: the server does not capture routing)."""
    text = choice.get(routed_experts.FIELD)
    if text is None:
        return None
    try:
        return routed_experts.decode(text)
    except ValueError as exc:
        raise ServerError(endpoint, 200, str(exc)) from exc

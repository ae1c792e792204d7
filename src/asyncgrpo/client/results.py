"""Parsed answers of the two generation endpoints (``/inference/v1/generate``, ``/v1/completions``).

Both parse into the same :class:`GenerationResult`, so callers do not care which
endpoint served them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.client.errors import ServerError

_NEG_INF_WIRE = -9999.0  # vLLM sends -inf log-probs as this number


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
    top_logprobs: list[dict[int, float]] | None = None
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


def parse_generate_choice(choice: Mapping[str, Any], request_id: str | None = None) -> GenerationResult:
    """Parse one choice of ``POST /inference/v1/generate``."""
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [_lp(e.get("logprob")) for e in content]
    top = None
    if content and any(e.get("top_logprobs") is not None for e in content):
        top = [{int(t["token_id"]): _lp(t["logprob"]) for t in e.get("top_logprobs") or []} for e in content]
    spans = _spans(choice)
    mask = choice.get("sampling_mask")
    return GenerationResult(
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=str(choice.get("finish_reason")),
        stop_reason=choice.get("stop_reason"),
        top_logprobs=top,
        sampling_mask=[[int(t) for t in row] for row in mask] if mask is not None else None,
        weight_versions=spans,
        request_id=request_id,
    )


def _token_id_key(key: str) -> int:
    if not key.startswith("token_id:"):
        raise ServerError(
            "POST /v1/completions", 200, f"top_logprobs key {key!r} is not 'token_id:<id>' (return_tokens_as_token_ids)"
        )
    return int(key.split(":", 1)[1])


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
    top = None
    if top_raw is not None:
        top = [{_token_id_key(k): _lp(v) for k, v in (d or {}).items()} for d in top_raw]
    return GenerationResult(
        token_ids=[int(t) for t in token_ids],
        logprobs=[_lp(v) for v in lp.get("token_logprobs") or []],
        finish_reason=str(choice.get("finish_reason")),
        stop_reason=choice.get("stop_reason"),
        top_logprobs=top,
        prompt_token_ids=choice.get("prompt_token_ids"),
        text=choice.get("text"),
        request_id=request_id,
        weight_versions=_spans(choice),
    )

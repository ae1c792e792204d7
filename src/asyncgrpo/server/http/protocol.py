"""Request validation and response bodies of the generation endpoints (vLLM 0.33 field names).

``parse_*`` turn a JSON body into engine :class:`Request` objects (``n`` expanded,
``max_tokens`` resolved) or raise :class:`ApiError` (HTTP 400 with vLLM's error
body); ``*_response`` build the JSON answers from the engine's outputs. No aiohttp
and no torch here, so the rules are readable (and testable) on their own.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncgrpo.routed_experts import FIELD, PROMPT_START
from asyncgrpo.routed_experts import encode as encode_routed
from asyncgrpo.server.engine.request import Request, RequestOutput, SamplingParams
from asyncgrpo.server.errors import ApiError
from asyncgrpo.server.http.wire_json import RawJSON, completion_logprobs_json, encode_with_raw, generate_content_json

logger = logging.getLogger(__name__)

NEG_INF_WIRE = -9999.0  # vLLM sends -inf log-probs as this number
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's /v1/completions default
MAX_CHOICES = 1024  # largest n: one request cannot occupy the server for minutes (GRPO groups are far smaller)
SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (vLLM's rule); dividing by them overflows the logits
MIN_REPETITION_PENALTY = 1e-4  # logits / penalty must stay finite in float32 (|logit| < 1e34 for any model)
MAX_TEMPERATURE = 2.0  # vLLM's SamplingParams rejects temperature > 2
# The sampling fields /v1/completions fills from generation_config.json when a request omits them (vLLM
# 0.33 ModelConfig.get_diff_sampling_param, with --generation-config auto).
GENERATION_CONFIG_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k",
                            "top_p", "min_p")  # fmt: skip
_internal_ids = itertools.count()

# Fields of vLLM's requests we do not implement: accepted only at their no-op value.
_NOOP_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "stop": (None, [], ""),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "prompt_logprobs": (None,),
    "stream": (False, None),
    "echo": (False, None),
    "suffix": (None,),
    "use_beam_search": (False, None),
    "truncate_prompt_tokens": (None,),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "response_format": (None,),
    "output_mode": ("tokens", None),
}


def encode_json(data: Any) -> bytes:
    """UTF-8 JSON of an answer body (compact; pre-encoded per-token parts spliced in, see ``wire_json``)."""
    return encode_with_raw(data)


def wire_float(x: float) -> float | None:
    """JSON-safe log-prob: -inf -> -9999.0 (vLLM's convention), NaN -> null."""
    if math.isnan(x):
        return None
    return NEG_INF_WIRE if x == -math.inf else float(x)


@dataclass
class ServerLimits:
    """What request validation needs to know about the server."""

    served_model_name: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int  # -1: the vocabulary size (vLLM)
    return_sampling_mask: bool
    lora_names: Callable[[], list[str]]
    # Defaults for the sampling fields a /v1/completions request omits (from generation_config.json), and the
    # cap on an omitted max_tokens of /inference/v1/generate (its max_new_tokens); empty / None: vLLM's neutral.
    generation_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    default_max_new_tokens: int | None = None


@dataclass
class ParsedRequest:
    """A validated generation request: ``requests`` holds one engine request per choice (``n``)."""

    request_id: str
    model: str
    lora_name: str | None
    prompt_token_ids: list[int]
    requests: list[Request]
    logprobs: int | None


# ---------------------------------------------------------------------- field readers


def _get(src: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any, *, optional: bool = False):
    value = src.get(key, default)
    if value is None and (optional or default is None):
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, float, (int, float)))
    if not ok:
        names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ApiError(400, f"{key} must be {names}, got {value!r}", param=key)
    return value


def _token_list(value: Any, key: str, vocab_size: int, *, allow_empty: bool = False) -> list[int]:
    # whole-list checks in C (a GRPO prompt is hundreds of ids, hundreds of requests at once)
    if not isinstance(value, list) or not set(map(type, value)) <= {int}:
        raise ApiError(400, f"{key} must be a list of token ids (integers)", param=key)
    if not value and not allow_empty:
        raise ApiError(400, f"{key} must not be empty", param=key)
    if value and (min(value) < 0 or max(value) >= vocab_size):
        bad = [t for t in value if not 0 <= t < vocab_size]
        raise ApiError(400, f"{key} holds ids {bad[:5]} outside the vocabulary [0, {vocab_size})", param=key)
    return value


def _check_noops(src: Mapping[str, Any]) -> None:
    for key, allowed in _NOOP_DEFAULTS.items():
        if key in src and src[key] not in allowed:
            raise ApiError(400, f"{key}={src[key]!r} is not supported by the embedded server", param=key)


def _resolve_model(model: Any, limits: ServerLimits) -> tuple[str, str | None]:
    """(reported model name, LoRA adapter or None); 404 for a model the server does not serve."""
    if model is None or model == limits.served_model_name:
        return limits.served_model_name, None
    if not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {model!r}", param="model")
    if model in limits.lora_names():
        return model, model
    raise ApiError(404, f"The model `{model}` does not exist.", param="model")


def _sampling(
    src: Mapping[str, Any],
    *,
    prompt_len: int,
    limits: ServerLimits,
    default_max_tokens: int | None,
    defaults: Mapping[str, Any] | None = None,
) -> tuple[SamplingParams, int]:
    """SamplingParams (one choice) and ``n`` from vLLM-named fields; ``defaults`` fill omitted (or null) fields."""
    _check_noops(src)
    if defaults:
        src = {**defaults, **{k: v for k, v in src.items() if v is not None}}
    room = limits.max_model_len - prompt_len
    max_tokens = _get(src, "max_tokens", int, None, optional=True)
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else default_max_tokens
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    temperature = _get(src, "temperature", float, 1.0, optional=True)
    top_p = _get(src, "top_p", float, 1.0, optional=True)
    top_k = _get(src, "top_k", int, 0, optional=True)
    min_p = _get(src, "min_p", float, 0.0, optional=True)
    rep = _get(src, "repetition_penalty", float, 1.0, optional=True)
    n = _get(src, "n", int, 1, optional=True)
    min_tokens = _get(src, "min_tokens", int, 0, optional=True)
    logprobs = _get(src, "logprobs", int, None, optional=True)
    max_logprobs = limits.vocab_size if limits.max_logprobs == -1 else limits.max_logprobs
    checks = [
        (temperature is None or 0 <= temperature <= MAX_TEMPERATURE, "temperature",
         f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}"),
        (top_p is None or 0 < top_p <= 1, "top_p", f"top_p must be in (0, 1], got {top_p}"),
        (top_k is None or top_k >= -1, "top_k", f"top_k must be -1, 0 (off) or at least 1, got {top_k}"),
        (min_p is None or 0 <= min_p <= 1, "min_p", f"min_p must be in [0, 1], got {min_p}"),
        (rep is None or rep >= MIN_REPETITION_PENALTY, "repetition_penalty",
         f"repetition_penalty must be >= {MIN_REPETITION_PENALTY:g} (smaller ones overflow the logits), got {rep}"),
        (n is None or 1 <= n <= MAX_CHOICES, "n", f"n must be in [1, {MAX_CHOICES}], got {n}"),
        (min_tokens is None or 0 <= min_tokens <= max_tokens, "min_tokens",
         f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}"),
        (logprobs is None or 0 <= logprobs <= max_logprobs, "logprobs",
         f"Requested sample logprobs of {logprobs}, which is greater than max allowed: {max_logprobs} (--max-logprobs)"),
        (0 <= (start := _get(src, PROMPT_START, int, 0, optional=True) or 0) <= prompt_len, PROMPT_START,
         f"{PROMPT_START} must be between 0 and the prompt length ({prompt_len}), inclusive, got {start}"),
    ]  # fmt: skip
    for ok, param, message in checks:
        if not ok:
            raise ApiError(400, message, param=param)
    stop_ids = src.get("stop_token_ids") or []
    stop_ids = _token_list(stop_ids, "stop_token_ids", limits.vocab_size, allow_empty=True)
    if temperature is not None and 0 < temperature < SAMPLING_EPS:
        temperature = 0.0
    max_tokens = min(max_tokens, room)  # prompt + output never passes max_model_len ("length" there)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_k=0 if top_k in (None, -1) else top_k,
        top_p=1.0 if top_p is None else top_p,
        min_p=min_p or 0.0,
        repetition_penalty=1.0 if rep is None else rep,
        seed=_get(src, "seed", int, None, optional=True),
        stop_token_ids=list(stop_ids),
        ignore_eos=bool(_get(src, "ignore_eos", bool, False, optional=True)),
        min_tokens=min(min_tokens or 0, max_tokens),
        logprobs=logprobs,
        routed_experts_prompt_start=start,
    )
    if limits.return_sampling_mask:
        # vLLM 0.33 (v1/engine/input_processor.py): with --return-sampling-mask every request on every endpoint
        # needs temperature > 0 and top_k > 0.
        if params.temperature <= 0:
            raise ApiError(400, "sampling distribution replay requires temperature > 0", param="temperature")
        if params.top_k <= 0:
            raise ApiError(400, "sampling distribution replay requires top_k > 0 to bound sampling mask size, "
                           "reduce transfer overhead, and avoid potential OOMs", param="top_k")  # fmt: skip
        params.return_sampling_mask = True
    return params, n or 1


def _expand(rid: str, prompt: list[int], params: SamplingParams, n: int, lora: str | None) -> list[Request]:
    """``n`` engine requests; seeded choices get seeds seed, seed+1, ... so they differ."""
    out = []
    for i in range(n):
        seed = None if params.seed is None else params.seed + i
        p = dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids), seed=seed)
        out.append(Request(f"{rid}#{i}#{next(_internal_ids)}", list(prompt), p, lora))
    return out


def _check_prompt_len(prompt: list[int], limits: ServerLimits) -> None:
    if len(prompt) >= limits.max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {limits.max_model_len} tokens. However, your request has "
            f"{len(prompt)} input tokens. Please reduce the length of the input (it must leave room for at least "
            "one output token).",
            param="input_tokens",
        )


# ---------------------------------------------------------------------- /inference/v1/generate


def parse_generate(body: Any, limits: ServerLimits) -> ParsedRequest:
    """Validate a ``POST /inference/v1/generate`` body."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_noops(body)
    prompt = _token_list(body.get("token_ids"), "token_ids", limits.vocab_size)
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp  # an empty list is not an empty object
    if not isinstance(sp, dict):
        raise ApiError(400, "sampling_params must be an object", param="sampling_params")
    model, lora = _resolve_model(body.get("model"), limits)
    _check_prompt_len(prompt, limits)
    cap = limits.default_max_new_tokens
    default_max = None if cap is None else min(cap, limits.max_model_len - len(prompt))
    params, n = _sampling(sp, prompt_len=len(prompt), limits=limits, default_max_tokens=default_max)
    rid = _get(body, "request_id", str, None, optional=True) or f"gen-{uuid.uuid4().hex}"
    return ParsedRequest(rid, model, lora, prompt, _expand(rid, prompt, params, n, lora), params.logprobs)


def _content_entry(out: RequestOutput, i: int) -> dict[str, Any]:
    token, lp = out.token_ids[i], out.logprobs[i]
    top = out.top_logprobs[i] if out.top_logprobs is not None else []
    ranked = [{"token_id": t, "logprob": wire_float(v), "rank": r + 1} for r, (t, v) in enumerate(top)]
    rank = next((e["rank"] for e in ranked if e["token_id"] == token), None)
    if rank is None:  # outside the returned top-N: count the better tokens we know of (exact for greedy)
        rank = 1 + sum(1 for _, v in top if v > lp)
    sampled = {"token_id": token, "logprob": wire_float(lp), "rank": rank}
    return {**sampled, "top_logprobs": [sampled, *ranked]}


def _listed(out: RequestOutput) -> RequestOutput:
    """``out`` with its top-N as per-position lists again (the dict paths index them position by position)."""
    if out.top_logprobs is None or isinstance(out.top_logprobs, list):
        return out
    return dataclasses.replace(out, top_logprobs=list(out.top_logprobs))


def generate_response(parsed: ParsedRequest, outputs: list[RequestOutput]) -> dict[str, Any]:
    choices = []
    for index, out in enumerate(outputs):
        logprobs: Any = None
        if parsed.logprobs is not None:
            raw = generate_content_json(out.token_ids, out.logprobs, out.top_logprobs)
            if raw is not None:
                logprobs = RawJSON(raw)
            else:  # -inf / NaN log-probs: the dict path writes vLLM's -9999.0 / null
                out = _listed(out)
                logprobs = {"content": [_content_entry(out, i) for i in range(len(out.token_ids))]}
        choices.append({
            "index": index,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
            "token_ids": list(out.token_ids),
            "logprobs": logprobs,
            "sampling_mask": out.sampling_mask,
            FIELD: _routed(out),
            "weight_versions": _spans(out),
        })  # fmt: skip
    completion = sum(len(o.token_ids) for o in outputs)
    return {
        "request_id": parsed.request_id,
        "model": parsed.model,
        "created": int(time.time()),
        "usage": _usage(len(parsed.prompt_token_ids), completion),
        "prompt_logprobs": None,
        "prompt_token_ids": parsed.prompt_token_ids,
        "choices": choices,
    }


def _routed(out: RequestOutput) -> str | None:
    """``routed_experts``: base64 ``.npy`` of the engine's array; null from an engine that does not capture."""
    return None if out.routed_experts is None else encode_routed(out.routed_experts)


def _spans(out: RequestOutput) -> list[dict[str, Any]]:
    return [{"version": s.version, "start": s.start, "end": s.end} for s in out.weight_versions]


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ---------------------------------------------------------------------- /v1/completions


@dataclass
class ParsedCompletion(ParsedRequest):
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    return_weight_versions: bool = False


def parse_completion(body: Any, limits: ServerLimits, encode: Callable[[str], list[int]]) -> ParsedCompletion:
    """Validate a ``POST /v1/completions`` body (token-id prompt, or a string encoded with the server's tokenizer)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        prompt = encode(prompt)
    prompt = _token_list(prompt, "prompt", limits.vocab_size)
    model, lora = _resolve_model(body.get("model"), limits)
    _check_prompt_len(prompt, limits)
    params, n = _sampling(
        body, prompt_len=len(prompt), limits=limits, default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        defaults=limits.generation_defaults,
    )  # fmt: skip
    rid = _get(body, "request_id", str, None, optional=True) or f"cmpl-{uuid.uuid4().hex}"
    return ParsedCompletion(
        rid, model, lora, prompt, _expand(rid, prompt, params, n, lora), params.logprobs,
        return_token_ids=bool(_get(body, "return_token_ids", bool, False, optional=True)),
        return_tokens_as_token_ids=bool(_get(body, "return_tokens_as_token_ids", bool, False, optional=True)),
        return_weight_versions=bool(_get(body, "return_weight_versions", bool, False, optional=True)),
    )  # fmt: skip


def completion_response(
    parsed: ParsedCompletion, outputs: list[RequestOutput], decode: Callable[[list[int]], str]
) -> dict[str, Any]:
    """The ``/v1/completions`` body; ``decode`` turns ids into text (special tokens skipped)."""

    def token_str(t: int) -> str:
        return f"token_id:{t}" if parsed.return_tokens_as_token_ids else decode([t])

    choices = []
    for index, out in enumerate(outputs):
        logprobs: Any = None
        raw = None
        if parsed.logprobs is not None and parsed.return_tokens_as_token_ids:
            raw = completion_logprobs_json(out.token_ids, out.logprobs, out.top_logprobs)
        if raw is not None:
            logprobs = RawJSON(raw)
        elif parsed.logprobs is not None:
            out = _listed(out)
            tokens = [token_str(t) for t in out.token_ids]
            offsets = list(itertools.accumulate((len(s) for s in tokens[:-1]), initial=0)) if tokens else []
            tops = []
            for i, t in enumerate(out.token_ids):
                entries = out.top_logprobs[i] if out.top_logprobs is not None else []
                d = {token_str(tid): wire_float(v) for tid, v in entries}
                d.setdefault(tokens[i], wire_float(out.logprobs[i]))  # the sampled token is always listed
                tops.append(d)
            logprobs = {
                "text_offset": offsets,
                "token_logprobs": [wire_float(v) for v in out.logprobs],
                "tokens": tokens,
                "top_logprobs": tops,
            }
        choice = {
            "index": index,
            "text": decode(list(out.token_ids)),
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
            "prompt_logprobs": None,
            FIELD: _routed(out),
            "weight_versions": _spans(out) if parsed.return_weight_versions else None,
        }
        if parsed.return_token_ids:
            choice["token_ids"] = list(out.token_ids)
            choice["prompt_token_ids"] = parsed.prompt_token_ids
        choices.append(choice)
    return {
        "id": parsed.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": parsed.model,
        "choices": choices,
        "usage": _usage(len(parsed.prompt_token_ids), sum(len(o.token_ids) for o in outputs)),
    }

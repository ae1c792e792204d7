"""Records exchanged between the embedded server's HTTP layer and its engine.

The HTTP layer (``http/app.py``) validates a request body, expands ``n`` into ``n``
single-sequence :class:`Request` objects and hands them to the engine; the
engine calls back with one :class:`RequestOutput` per request. Nothing here
imports torch, so the HTTP layer stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort"]
PauseMode = Literal["abort", "wait", "keep"]


@dataclass
class SamplingParams:
    """vLLM SamplingParams subset, with vLLM's meaning.

    ``top_k`` 0 or -1 means off; ``top_p`` 1.0 means off; ``min_p`` 0.0 means off.
    ``max_tokens`` is always resolved by the HTTP layer (never None here).
    ``logprobs`` is the number of top log-probs returned per position (None: only
    the sampled token's). ``seed`` None means the engine's global RNG.
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    return_sampling_mask: bool = False
    routed_experts_prompt_start: int = 0  # first prompt token whose routing is returned (vLLM 0.33)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Request:
    """One sequence to generate. Invariant: ``len(prompt_token_ids) < max_model_len``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_name: str | None = None


@dataclass
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were generated with weights ``version``."""

    version: str
    start: int
    end: int


@dataclass
class RequestOutput:
    """The finished sequence. All per-token lists share the length of ``token_ids``.

    ``logprobs[i]`` is the processed log-prob of ``token_ids[i]`` (the distribution
    actually sampled from). ``top_logprobs[i]`` lists ``(token_id, logprob)`` of the
    ``params.logprobs`` most likely tokens of that same distribution, best first
    (None when not requested). ``sampling_mask[i]`` is the sorted list of token ids
    that survived top-k/top-p/min-p at step i (None unless requested).
    EOS/stop tokens are included in ``token_ids``. ``routed_experts`` (a numpy array, engines started with
    ``enable_return_routed_experts``): ``[prompt + output - 1 - start, layers, top_k]`` expert ids of the
    forwarded tokens from ``params.routed_experts_prompt_start`` on (``asyncgrpo.routed_experts``).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_reason: int | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    sampling_mask: list[list[int]] | None = None
    weight_versions: list[WeightVersionSpan] = field(default_factory=list)
    error: str | None = None
    routed_experts: Any = None


@dataclass
class EngineStats:
    """Live engine state behind ``/metrics``."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, fraction of KV blocks in use
    num_preemptions_total: int
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries_total: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # of those, tokens whose cached K/V was reused
    prefill_tokens_computed_total: int = 0  # tokens prefill steps computed (extension, not a vLLM name)


def validate_request(request: Request, max_model_len: int, vocab_size: int, lora_names: list[str]) -> None:
    """ValueError with what to change for a request the engine cannot run (shared by the engine and its proxy)."""
    ids, p = request.prompt_token_ids, request.params
    if not ids:
        raise ValueError("prompt_token_ids must not be empty")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; it must be shorter than max_model_len={max_model_len}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if request.lora_name is not None and request.lora_name not in lora_names:
        raise ValueError(f"unknown LoRA adapter {request.lora_name!r}; loaded: {lora_names}")
    checks = [
        (p.max_tokens >= 1, f"max_tokens must be >= 1, got {p.max_tokens}"),
        (p.temperature >= 0.0, f"temperature must be >= 0, got {p.temperature}"),
        (0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}"),
        (p.top_k >= -1, f"top_k must be -1, 0 (off) or positive, got {p.top_k}"),
        (0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}"),
        (p.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {p.repetition_penalty}"),
        (0 <= p.min_tokens <= p.max_tokens, f"min_tokens ({p.min_tokens}) must be in [0, max_tokens]"),
        (p.logprobs is None or 0 <= p.logprobs <= vocab_size, f"logprobs must be >= 0, got {p.logprobs}"),
        (
            0 <= p.routed_experts_prompt_start <= len(ids),
            f"routed_experts_prompt_start must be in [0, {len(ids)}] (the prompt), got {p.routed_experts_prompt_start}",
        ),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)

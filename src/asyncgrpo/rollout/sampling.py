"""Sampling settings resolved against the server at start (G7–G9, G12).

The trainer builds one :class:`SamplingSettings` in the parent process after
asking the server for its limits and capabilities, and hands it to the rollout
loop inside its ``RolloutSettings`` (``rollout/settings.py``), so the worker never
has to re-discover them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def truncates_distribution(top_k: int, top_p: float, min_p: float | None) -> bool:
    """Top-k/top-p/min-p truncate the distribution: the trainer must renormalise over candidate sets (G9)."""
    return top_k > 0 or top_p < 1.0 or bool(min_p)


@dataclass(frozen=True)
class SamplingSettings:
    """Plain values the rollout loop needs to build requests (picklable)."""

    base_url: str  # the first server (X5: ``base_urls`` lists them all when there are several)
    max_model_len: int  # the smallest of the servers'
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    num_sampler_logprobs: int | None = None  # top-N per position for score centering (None: centering off)
    kv_cache_tokens: int | None = None
    has_metrics: bool = True
    masks_supported: bool = False  # the server returns sampling masks (checked at start)
    initial_tokens_per_step: int = 1  # token_budget × rows per step (G3's first-step assumption)
    base_urls: tuple[str, ...] = ()  # every server of the run, when there are several (X5)
    routed_experts: bool = False  # MoE routing replay: each turn carries the server's routed_experts

    @property
    def urls(self) -> tuple[str, ...]:
        """Every generation server of the run, in the config's order."""
        return self.base_urls or (self.base_url,)

    @property
    def wants_masks(self) -> bool:
        """Whether the trainer needs each position's candidate set (see :func:`truncates_distribution`)."""
        return truncates_distribution(self.top_k, self.top_p, self.min_p)

    @property
    def use_generate_endpoint(self) -> bool:
        """``/inference/v1/generate`` returns masks; otherwise ``/v1/completions`` (always on a real vLLM)."""
        return self.wants_masks and self.masks_supported

    def request_params(self, prompt_len: int, seed: int) -> dict[str, Any]:
        """vLLM SamplingParams for one turn of a ``prompt_len``-token prompt."""
        room = self.max_model_len - prompt_len
        if room <= 0:
            raise ValueError(
                f"a prompt of {prompt_len} tokens leaves no room under the server's max_model_len "
                f"{self.max_model_len}; shorten the prompts or restart the server with a larger --max-model-len"
            )
        params: dict[str, Any] = {
            "max_tokens": min(self.max_completion_length, room),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": max(self.top_k, 0),  # 0 = off (vLLM also takes -1, but a masking server rejects both)
            "repetition_penalty": self.repetition_penalty,
            "seed": seed,
            "logprobs": self.num_sampler_logprobs or 0,
        }
        params["min_p"] = self.min_p or 0.0  # explicit: vLLM fills omitted fields from generation_config.json
        return params

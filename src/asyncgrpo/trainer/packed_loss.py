"""The policy loss of one packed row from its final hidden states: LM head, log-probs, loss and metrics.

One small function the trainer calls (and the benchmarks time), so the packed step's LM-head path lives in
one place. ``fused_lm_head`` (default) forms the gradient during the forward (``trainer/fused_head.py``: no
second LM-head forward in the backward); False runs ``selective_logprobs`` + ``policy_loss`` with the
recomputing backward, kept as the reference the fused path is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.trainer.fused_head import fused_logprobs_loss
from asyncgrpo.trainer.logprobs import selective_logprobs
from asyncgrpo.trainer.loss import LossOutput, policy_loss, policy_loss_value

__all__ = ["PolicyLossSettings", "packed_policy_loss"]


@dataclass(frozen=True)
class PolicyLossSettings:
    """The loss knobs of ``AsyncGRPOConfig`` that the packed loss reads."""

    temperature: float = 1.0
    clip_min: float = 0.5
    clip_max: float = 5.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    fused_lm_head: bool = True
    chunk_size: int | None = None

    def knobs(self) -> dict[str, Any]:
        return {"clip_min": self.clip_min, "clip_max": self.clip_max, "epsilon_low": self.epsilon_low,
                "epsilon_high": self.epsilon_high}  # fmt: skip


def packed_policy_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    row: Any,
    normalizer: float | torch.Tensor,
    settings: PolicyLossSettings,
) -> LossOutput:
    """Loss and metrics of the trained tokens of ``row`` (a ``PackedRow`` on the model's device).

    Args:
        hidden: [M, H] final hidden states at ``row.pred_index`` (the position predicting each trained token).
        head_weight: [V, H] LM head weight.
        row: its ``target_ids``, ``old_logprobs``, ``advantages``, ``sampler_topn_ids``/``_logprobs`` (None
            without score centering), ``candidates`` and ``entry_sample`` are read.
        normalizer: denominator of the summed loss (``loss_normalizer``).
        settings: the loss knobs.
    """
    use_top = row.sampler_topn_ids is not None  # the worker sends top-N only with score centering on
    mask = torch.ones_like(row.target_ids, dtype=torch.bool)
    sampler_top = row.sampler_topn_logprobs if use_top else None
    common = {"temperature": settings.temperature, "extra_ids": row.sampler_topn_ids if use_top else None,
              "candidates": row.candidates, "want_entropy": True, "chunk_size": settings.chunk_size}  # fmt: skip
    if not settings.fused_lm_head:
        out = selective_logprobs(hidden, head_weight, row.target_ids, **common)
        return policy_loss(
            out.logprobs, row.old_logprobs, row.advantages, mask, normalizer, score_centering=use_top,
            top_logprobs=out.extra_logprobs, sampler_top_logprobs=sampler_top, sample_index=row.entry_sample,
            entropy=out.entropy, **settings.knobs(),
        )  # fmt: skip

    def chunk_loss(lo: int, hi: int, lp: torch.Tensor, extra_lp: torch.Tensor | None) -> torch.Tensor:
        return policy_loss_value(
            lp, row.old_logprobs[lo:hi], row.advantages[lo:hi], mask[lo:hi], normalizer, score_centering=use_top,
            top_logprobs=extra_lp, sampler_top_logprobs=sampler_top[lo:hi] if use_top else None, **settings.knobs(),
        )  # fmt: skip

    loss, out = fused_logprobs_loss(hidden, head_weight, row.target_ids, chunk_loss, **common)
    metrics = policy_loss(
        out.logprobs, row.old_logprobs, row.advantages, mask, normalizer, score_centering=use_top,
        top_logprobs=out.extra_logprobs, sampler_top_logprobs=sampler_top, sample_index=row.entry_sample,
        entropy=out.entropy, **settings.knobs(),
    ).metrics  # fmt: skip
    return LossOutput(loss=loss, metrics=metrics)

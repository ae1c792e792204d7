"""The policy loss of one packed row from its final hidden states: LM head, log-probs, loss and metrics.

One small function the trainer calls (and the benchmarks time), so the packed step's LM-head path lives in
one place. ``fused_lm_head`` (default) forms the gradient during the forward (``trainer/fused_head.py``: no
second LM-head forward in the backward); False runs ``selective_logprobs`` + ``policy_loss`` with the
recomputing backward, kept as the reference the fused path is tested against. TRL's loss families
(``loss_families.py``) take the same two paths; GSPO's sequence ratio and the sequence-level corrections first
run the head once without gradient (the same kernels) for the detached sequence sums, so every token's loss
depends on its own log-probs only and the fused head still applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.trainer.fused_head import fused_logprobs_loss
from asyncgrpo.trainer.logprobs import selective_logprobs
from asyncgrpo.trainer.loss import LossOutput, policy_loss, policy_loss_value
from asyncgrpo.trainer.loss_families import FamilySettings, family_loss, family_loss_value, sequence_stats
from asyncgrpo.trainer.sampler_correction import Correction, mask_bounds

__all__ = ["PolicyLossSettings", "loss_settings", "packed_policy_loss"]


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
    family: FamilySettings | None = None  # None: the reference objective (loss_type="asyncgrpo")

    def knobs(self) -> dict[str, Any]:
        return {"clip_min": self.clip_min, "clip_max": self.clip_max, "epsilon_low": self.epsilon_low,
                "epsilon_high": self.epsilon_high}  # fmt: skip


def loss_settings(args: Any) -> PolicyLossSettings:
    """The packed loss's knobs from an ``AsyncGRPOConfig``: the reference objective reads only the correction's
    mask band (token_mask or icepop, or none when the correction is off); a TRL family gets all of it."""
    corr = Correction(
        mode=args.vllm_importance_sampling_mode if args.vllm_importance_sampling_correction else None,
        clip_min=args.vllm_importance_sampling_clip_min,
        clip_max=args.vllm_importance_sampling_clip_max,
    )
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    family = None
    if args.loss_type != "asyncgrpo":
        family = FamilySettings(args.loss_type, args.importance_sampling_level, args.epsilon, eps_high, corr)
    lo, hi = mask_bounds(corr)
    return PolicyLossSettings(temperature=args.temperature, clip_min=lo, clip_max=hi, epsilon_low=args.epsilon,
                              epsilon_high=eps_high, family=family)  # fmt: skip


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
    if settings.family is not None:
        return _family_packed_loss(hidden, head_weight, row, normalizer, settings)
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
            entropy=out.entropy, num_samples=_num_samples(row), **settings.knobs(),
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
        entropy=out.entropy, num_samples=_num_samples(row), **settings.knobs(),
    ).metrics  # fmt: skip
    return LossOutput(loss=loss, metrics=metrics)


def _family_packed_loss(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    row: Any,
    normalizer: float | torch.Tensor,
    settings: PolicyLossSettings,
) -> LossOutput:
    """``packed_policy_loss`` for one of TRL's families (``settings.family``)."""
    fam = settings.family
    assert fam is not None
    mask = torch.ones_like(row.target_ids, dtype=torch.bool)
    seq = row.entry_sample
    common = {"temperature": settings.temperature, "candidates": row.candidates, "chunk_size": settings.chunk_size}
    if not settings.fused_lm_head:
        out = selective_logprobs(hidden, head_weight, row.target_ids, want_entropy=True, **common)
        return family_loss(out.logprobs, row.old_logprobs, row.advantages, mask, seq, normalizer, fam,
                           entropy=out.entropy)  # fmt: skip
    lp_all = row.old_logprobs  # token-level: the stats' ratios are unused, only the sequence lengths
    if fam.sequence_level or fam.correction.sequence_level:
        with torch.no_grad():  # the same head kernels as the pass below, so the sums match its log-probs
            _, pre = fused_logprobs_loss(hidden, head_weight, row.target_ids, lambda lo, hi, lp, ex: lp.sum() * 0,
                                         **common)  # fmt: skip
        lp_all = pre.logprobs
    stats = sequence_stats(lp_all, row.old_logprobs, mask, seq, fam)

    def chunk_loss(lo: int, hi: int, lp: torch.Tensor, _extra: torch.Tensor | None) -> torch.Tensor:
        return family_loss_value(lp, row.old_logprobs[lo:hi], row.advantages[lo:hi], mask[lo:hi],
                                 stats.slice(lo, hi), normalizer, fam)  # fmt: skip

    loss, out = fused_logprobs_loss(hidden, head_weight, row.target_ids, chunk_loss, want_entropy=True, **common)
    metrics = family_loss(out.logprobs, row.old_logprobs, row.advantages, mask, seq, normalizer, fam, stats=stats,
                          entropy=out.entropy).metrics  # fmt: skip
    return LossOutput(loss=loss, metrics=metrics)


def _num_samples(row: Any) -> int | None:
    """The row's sample count, read on the host (the per-sample clip metrics need no device sync for it)."""
    samples = getattr(row, "samples", None)
    return len(samples) if samples is not None else None

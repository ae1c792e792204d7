"""Sampler-mismatch corrections: a detached weight per trained token from the trainer/sampler ratio.

The sampler's log-probs differ from the trainer's by staleness (the sample was drawn ``k`` updates ago) and by
numerics (another kernel, another precision). With q_t = pi_trainer(o_t) / pi_sampler(o_t), where pi_trainer is
the trainer's policy at the step that trains the sample (detached: every sample is trained once, so this is
TRL's pi_old), and Q_i = prod over sequence i's trained tokens of q_t, the weight w is (TRL's names):

    token_truncate     w_t = clamp(q_t, C_min, C_max)                 truncated IS (TIS)
    token_mask         w_t = q_t * 1[C_min <= q_t <= C_max]           masked IS (MIS)
    sequence_truncate  w_t = clamp(Q_i, C_min, C_max)
    sequence_mask      w_t = Q_i * 1[C_min <= Q_i <= C_max]
    icepop             w_t = q_t * 1[1/C_max <= q_t <= C_max]          IcePop's two-sided token mask

The loss families multiply each token's loss by w (``loss_families.py``). The reference objective
(``loss.py``) takes only the mask of token_mask / icepop, through :func:`mask_bounds` and :func:`in_bounds`: one
definition of "the ratio left the band" serves both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Correction", "correction_weight", "in_bounds", "mask_bounds"]


@dataclass(frozen=True)
class Correction:
    """The resolved correction: ``mode`` None means off (weight 1)."""

    mode: str | None = "token_mask"
    clip_min: float = 0.5
    clip_max: float = 5.0

    @property
    def sequence_level(self) -> bool:
        return self.mode in ("sequence_mask", "sequence_truncate")

    @property
    def masks(self) -> bool:
        return self.mode in ("token_mask", "sequence_mask", "icepop")


def mask_bounds(c: Correction) -> tuple[float, float]:
    """The band a ratio must lie in to keep its token: [0, inf] when off, [1/C_max, C_max] for icepop."""
    if c.mode is None:
        return 0.0, math.inf
    if c.mode == "icepop":
        return 1.0 / c.clip_max, c.clip_max
    return c.clip_min, c.clip_max


def in_bounds(ratio: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """True where ``lo <= ratio <= hi`` (the keep mask of masked importance sampling)."""
    return (ratio >= lo) & (ratio <= hi)


@dataclass
class CorrectionWeight:
    """Per-token weight (detached) and the flags its metrics count."""

    weight: torch.Tensor  # [N]
    masked: torch.Tensor  # [N] bool: weight zeroed by the mask
    truncated: torch.Tensor  # [N] bool: ratio clamped
    ratio: torch.Tensor  # [N] the ratio the mode uses (q_t, or Q_i broadcast to the sequence's tokens)


def correction_weight(
    token_log_ratio: torch.Tensor, seq_log_ratio: torch.Tensor | None, c: Correction
) -> CorrectionWeight:
    """The weight of every token.

    Args:
        token_log_ratio: [N] log q_t = log pi_trainer - log pi_sampler (detached; 0 where untrained).
        seq_log_ratio: [N] log Q_i of each token's sequence (sum over its trained tokens), for sequence modes.
        c: the resolved correction.
    """
    lr = token_log_ratio.detach()
    if c.mode is None:
        one = torch.ones_like(lr)
        no = torch.zeros_like(lr, dtype=torch.bool)
        return CorrectionWeight(one, no, no, torch.exp(lr))
    if c.sequence_level:
        if seq_log_ratio is None:
            raise ValueError(f"vllm_importance_sampling_mode={c.mode!r} needs the sequence log-ratios")
        lr = seq_log_ratio.detach()
    ratio = torch.exp(lr)
    if c.masks:
        lo, hi = mask_bounds(c)
        keep = in_bounds(ratio, lo, hi)
        weight = torch.where(keep, ratio, 0.0)
        return CorrectionWeight(weight, ~keep, torch.zeros_like(keep), ratio)
    weight = ratio.clamp(min=c.clip_min, max=c.clip_max)
    truncated = (ratio < c.clip_min) | (ratio > c.clip_max)
    return CorrectionWeight(weight, torch.zeros_like(truncated), truncated, ratio)

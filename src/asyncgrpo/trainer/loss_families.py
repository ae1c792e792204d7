"""TRL's loss families (``loss_type`` grpo, bnpo, dr_grpo, dapo, cispo; GSPO's sequence ratio), from their papers.

Per trained token t of sequence i, with advantage A_i, policy ratio rho and correction weight w
(``sampler_correction.py``):

    clipped surrogate (grpo, bnpo, dr_grpo, dapo)   l_t = -w_t min(rho A_i, clip(rho, 1 - eps_low, 1 + eps_high) A_i)
    cispo (MiniMax-M1)                             l_t = -w_t sg(min(rho, eps_high)) A_i log pi_theta(o_t)

The old policy of rho: with the correction on, the trainer's own policy at this step, detached (a sample is
trained once, in one step: TRL's pi_old), so rho = pi_theta / sg(pi_theta) (value 1) and the whole
trainer/sampler gap is the correction's; with the correction off, the sampler (L1 of the reference), so the
trust region holds the gap. ``importance_sampling_level="sequence"`` (GSPO) replaces rho by
s_i = exp(mean over sequence i of log pi_theta - log pi_old) with the sequence's loss sum_t w_t l(s_i);
``"sequence_token"`` (GSPO-token) by s_it = sg(s_i) pi_theta(o_t) / sg(pi_theta(o_t)) with w_t l(s_it). Both are
computed in the GSPO-token form, GSPO weighing every token by the sequence's mean w (the same value and gradient
as the sequence form, A being per sequence; the two differ only under token-level corrections). That form keeps
the loss a sum of per-token terms given the detached sequence sums (``sequence_stats``), which the fused LM head
needs.

The sum over tokens is divided as the family says (``family_normalizer``): grpo weighs each token 1/|o_i| and
divides by the micro-batch's sequences; bnpo by its tokens; dr_grpo by sequences x max_completion_length; dapo and
cispo by the step's tokens. Counts are over every process's rows (rank 0 plans the step and knows them all),
times ``gradient_accumulation_steps`` where the family averages micro-batches, divided by the process count that
the gradient all-reduce averages over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncgrpo.trainer.loss import (
    LossOutput,
    _masked_extreme,
    _masked_mean,
    _per_sample_fraction_extreme,
    _segment_count,
    _segment_totals,
    _up,
)
from asyncgrpo.trainer.sampler_correction import Correction, correction_weight

__all__ = ["FamilySettings", "SequenceStats", "family_loss", "family_loss_value", "family_normalizer", "sequence_stats"]


@dataclass(frozen=True)
class FamilySettings:
    """The knobs one of TRL's loss families reads."""

    loss_type: str = "dapo"
    level: str = "token"  # importance_sampling_level: token, sequence (GSPO) or sequence_token (GSPO-token)
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    correction: Correction = field(default_factory=Correction)

    @property
    def sequence_level(self) -> bool:
        return self.level != "token"

    @property
    def sampler_is_old(self) -> bool:
        """Without a correction the sampler is the old policy of the ratio (L1)."""
        return self.correction.mode is None


@dataclass
class SequenceStats:
    """Per-token views of per-sequence quantities, detached: computed before the loss from all log-probs."""

    length: torch.Tensor  # [N] trained tokens of the token's sequence
    mean_log_ratio: torch.Tensor  # [N] mean over the sequence of log pi_theta - log pi_old (GSPO's log s_i)
    sum_sampler_log_ratio: torch.Tensor  # [N] sum over the sequence of log pi_theta - log pi_sampler (log Q_i)
    mean_weight: torch.Tensor  # [N] mean over the sequence of the correction weight (GSPO weighs s_i by it)

    def slice(self, lo: int, hi: int) -> SequenceStats:
        """The stats of tokens [lo, hi) (a chunk of the fused LM head)."""
        return SequenceStats(self.length[lo:hi], self.mean_log_ratio[lo:hi], self.sum_sampler_log_ratio[lo:hi],
                             self.mean_weight[lo:hi])  # fmt: skip


def _segment_sum(values: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    return _segment_totals(values, seq, _segment_count(seq))[seq]


def sequence_stats(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    seq: torch.Tensor,
    s: FamilySettings,
) -> SequenceStats:
    """The sequence quantities of every token from the (detached) log-probs of all trained tokens of the row."""
    mask = loss_mask.bool()
    lp = _up(logprobs.detach())
    sampler_lr = torch.where(mask, lp - _up(sampler_logprobs), 0.0)
    length = _segment_sum(mask.to(lp.dtype), seq)
    sum_sampler = _segment_sum(sampler_lr, seq)
    mean_old = sum_sampler / length.clamp(min=1) if s.sampler_is_old else torch.zeros_like(lp)
    weight = torch.where(mask, correction_weight(sampler_lr, sum_sampler, s.correction).weight, 0.0)
    mean_weight = _segment_sum(weight, seq) / length.clamp(min=1)
    return SequenceStats(length, mean_old, sum_sampler, mean_weight)


def family_normalizer(
    loss_type: str,
    tokens: float,
    sequences: float,
    step_tokens: float,
    max_completion_length: int,
    gradient_accumulation_steps: int,
    num_processes: int = 1,
) -> float:
    """Denominator of a micro-batch's summed per-token loss (every count over all processes).

    Args:
        loss_type: the family (``asyncgrpo`` and ``bnpo`` share the reference's L5).
        tokens: trained tokens of the micro-batch; sequences: its sequences; step_tokens: trained tokens of the step.
        max_completion_length: dr_grpo's constant.
        gradient_accumulation_steps, num_processes: micro-batches per step and data-parallel processes.
    """
    ga, procs = gradient_accumulation_steps, num_processes
    if loss_type in ("dapo", "cispo"):
        return max(step_tokens, 1) / procs
    if loss_type == "grpo":
        return max(sequences, 1) * ga / procs
    if loss_type == "dr_grpo":
        return max(sequences, 1) * max_completion_length * ga / procs
    return max(tokens, 1) * ga / procs


def _token_terms(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    stats: SequenceStats,
    s: FamilySettings,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss (before the normaliser, after grpo's 1/|o_i|) and the detached tensors its metrics read."""
    lp = _up(logprobs)
    sampler = _up(sampler_logprobs).detach()
    adv = _up(advantages).detach()
    sampler_lr = torch.where(mask, lp.detach() - sampler, 0.0)  # log q_t
    old = sampler if s.sampler_is_old else lp.detach()
    token_lr = torch.where(mask, lp - old, 0.0)  # differentiable log rho_t
    if s.sequence_level:  # GSPO-token: sg(s_i) * pi / sg(pi)
        log_rho = stats.mean_log_ratio.to(lp.dtype) + (token_lr - token_lr.detach())
    else:
        log_rho = token_lr
    rho = torch.exp(log_rho)
    r = rho.detach()
    cw = correction_weight(sampler_lr, stats.sum_sampler_log_ratio.to(lp.dtype), s.correction)
    if s.loss_type == "cispo":
        capped = r.clamp(max=s.epsilon_high)
        per_token = -capped * adv * torch.where(mask, lp, 0.0)
        low, high = torch.zeros_like(mask), r > s.epsilon_high
    else:
        clipped = torch.clamp(rho, 1.0 - s.epsilon_low, 1.0 + s.epsilon_high)
        per_token = -torch.minimum(rho * adv, clipped * adv)
        low, high = (r < 1.0 - s.epsilon_low) & (adv < 0), (r > 1.0 + s.epsilon_high) & (adv > 0)
    # GSPO: sum_t w_t l(s_i) = |o_i| mean(w) l(s_i), so each token carries the sequence's mean weight; GSPO-token
    # weighs each token's own term by its own w_t.
    # (CISPO's term is not a function of s_i alone: its tokens keep their own weights.)
    weight = stats.mean_weight if s.level == "sequence" and s.loss_type != "cispo" else cw.weight
    per_token = per_token * weight.to(lp.dtype)
    if s.loss_type == "grpo":
        per_token = per_token / stats.length.to(lp.dtype).clamp(min=1)
    per_token = torch.where(mask, per_token, 0.0)
    parts = {"q": torch.exp(sampler_lr), "diff": sampler_lr.abs(), "rho": r, "low": low, "high": high,
             "masked": cw.masked, "truncated": cw.truncated, "seq_ratio": cw.ratio}  # fmt: skip
    return per_token, parts


def family_loss_value(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    stats: SequenceStats,
    normalizer: float | torch.Tensor,
    settings: FamilySettings,
) -> torch.Tensor:
    """The loss alone: a sum of per-token terms over the normaliser (the fused LM head's chunk loss)."""
    per_token, _ = _token_terms(logprobs, sampler_logprobs, advantages, loss_mask.bool(), stats, settings)
    return per_token.sum() / normalizer


def family_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    seq: torch.Tensor,
    normalizer: float | torch.Tensor,
    settings: FamilySettings,
    *,
    stats: SequenceStats | None = None,
    entropy: torch.Tensor | None = None,
) -> LossOutput:
    """Loss and metrics of one micro-batch.

    Args:
        logprobs: [N] current log-probs of the sampled tokens (requires grad).
        sampler_logprobs: [N] the sampler's log-probs of them.
        advantages: [N] each token's sequence advantage.
        loss_mask: [N] True on trained tokens (tool results and prompts are False, or absent).
        seq: [N] sequence index of each token; a sequence's tokens all lie in this call.
        normalizer: ``family_normalizer``'s denominator.
        settings: the family.
        stats: the sequence quantities, when already computed (else from ``logprobs``).
        entropy: [N] per-token entropy, averaged into ``entropy``.
    """
    mask = loss_mask.bool()
    if stats is None:
        stats = sequence_stats(logprobs, sampler_logprobs, mask, seq, settings)
    per_token, x = _token_terms(logprobs, sampler_logprobs, advantages, mask, stats, settings)
    loss = per_token.sum() / normalizer
    count = mask.sum()
    metrics = {
        "sampling/sampling_logp_difference/mean": _masked_mean(x["diff"], mask, count),
        "sampling/sampling_logp_difference/max": _masked_extreme(x["diff"], mask, largest=True),
        "sampling/importance_sampling_ratio/min": _masked_extreme(x["q"], mask, largest=False),
        "sampling/importance_sampling_ratio/mean": _masked_mean(x["q"], mask, count),
        "sampling/importance_sampling_ratio/max": _masked_extreme(x["q"], mask, largest=True),
        "sampling/masked_mean": _masked_mean(x["masked"].float(), mask, count),
        "sampling/truncated_mean": _masked_mean(x["truncated"].float(), mask, count),
        "policy_ratio/mean": _masked_mean(x["rho"], mask, count),
        "policy_ratio/max": _masked_extreme(x["rho"], mask, largest=True),
        "clip_ratio/low_mean": _masked_mean(x["low"].float(), mask, count),
        "clip_ratio/low_min": _per_sample_fraction_extreme(x["low"], mask, seq, largest=False),
        "clip_ratio/high_mean": _masked_mean(x["high"].float(), mask, count),
        "clip_ratio/high_max": _per_sample_fraction_extreme(x["high"], mask, seq, largest=True),
        "clip_ratio/region_mean": _masked_mean((x["low"] | x["high"]).float(), mask, count),
    }
    if settings.correction.sequence_level:  # one value per sequence: its first trained token stands for it
        trained = torch.nonzero(mask).view(-1)
        s_tr = seq[trained]
        starts = torch.cat(
            [torch.ones(min(1, s_tr.numel()), dtype=torch.bool, device=seq.device), s_tr[1:] != s_tr[:-1]]
        )
        first = torch.zeros_like(mask)
        first[trained[starts]] = True
        n_seq = first.sum()
        metrics["sampling/sequence_ratio/mean"] = _masked_mean(x["seq_ratio"], first, n_seq)
        metrics["sampling/sequence_ratio/max"] = _masked_extreme(x["seq_ratio"], first, largest=True)
        metrics["sampling/sequence_masked_mean"] = _masked_mean(x["masked"].float(), first, n_seq)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(_up(entropy.detach()), mask, count)
    return LossOutput(loss=loss, metrics=metrics)

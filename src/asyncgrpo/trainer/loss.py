"""Policy loss of one packed micro-batch: masked importance sampling + score centering or the clipped surrogate.

The sampler's log-probs are the old policy (L1), so one ratio r = pi_theta / pi_sampler covers both the
train-inference mismatch and staleness. Tokens whose ratio leaves [C_min, C_max] are excluded (L2, masked
importance sampling). Two objectives share that mask:

- score centering (L3, default). Per trained token t, with f(r) = r inside [C_min, C_max] and 0 outside,
      grad L_t = -A_t * ( f(r_t) grad log pi(o_t) - sum_{v in top-N_t} mu(v) f(r_v) grad log pi(v) )
  where top-N_t are the sampler's `num_sampler_logprobs` most likely tokens at the position and mu their
  sampler probabilities as reported (not renormalised: the probability mass they do not cover contributes
  nothing; `sampling/sampler_mass` logs how much they cover). Since mu(v) r_v grad log pi(v) = grad pi(v), the
  surrogate implemented is  L_t = -A_t * ( m_t r_t - sum_v m_v pi(v) )  with m = 1[C_min <= r <= C_max]
  detached, whose gradient is exactly the one above. On-policy its value is -A_t * (1 - covered mass).
  The centering term applies at every trained position, including ones whose sampled token is masked.
- clipped surrogate (L4, `score_centering=False`):
      L_t = -m_t * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t).

Both are summed over trained tokens and divided by a normaliser the caller passes (L5): the micro-batch's
trained-token count summed over processes, times `gradient_accumulation_steps` (see `loss_normalizer`).
Current log-probs (temperature applied, renormalised over top-k/top-p candidate sets where used) and
entropies come from `trainer/logprobs.py`; this module only combines per-token tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncgrpo.trainer.sampler_correction import in_bounds

__all__ = ["LossOutput", "loss_normalizer", "policy_loss", "policy_loss_value"]


@dataclass
class LossOutput:
    """Loss of one micro-batch and its metrics.

    Attributes:
        loss: Scalar to call `backward()` on, already divided by the normaliser.
        metrics: name -> (value, weight), detached 0-d tensors (no host sync yet); weight is the number of trained
            tokens the value averages (1 for min/max), as `MetricsWindow.add` expects.
    """

    loss: torch.Tensor
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def metric_events(self) -> list[tuple[str, float, float]]:
        """Metrics as `(name, value, weight)` floats. One copy from the device (one sync, not one per value: on a GPU
        shared with the server each sync waits for the trainer's turn); call once per step, not per token."""
        flat: list[Any] = [t for vw in self.metrics.values() for t in vw]
        on: dict[torch.device, list[int]] = {}  # one copy per device the values live on
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                on.setdefault(t.device, []).append(i)
        for at in on.values():
            values = torch.stack([flat[i].detach().to(torch.float64).reshape(()) for i in at]).tolist()
            for i, value in zip(at, values, strict=True):
                flat[i] = value
        return [(name, float(flat[2 * i]), float(flat[2 * i + 1])) for i, name in enumerate(self.metrics)]


def loss_normalizer(
    global_trained_tokens: float | torch.Tensor,
    gradient_accumulation_steps: int,
    num_processes: int = 1,
    grads_averaged_across_processes: bool = True,
) -> float | torch.Tensor:
    """Denominator for one micro-batch's summed per-token loss (L5).

    The normalisation of L5 (docs/spec.md) is: divide by the micro-batch's trained tokens summed over all processes, and
    average over the `gradient_accumulation_steps` micro-batches of a step. DDP and FSDP average gradients over
    processes, which divides by `num_processes` once more; multiplying it back makes the step's gradient exactly
    (1 / GA) * sum over micro-batches of (sum over all processes' tokens of grad L_t) / (micro-batch global tokens).

    Args:
        global_trained_tokens: Trained tokens of this micro-batch over all processes (an all-reduced count).
        gradient_accumulation_steps: Micro-batches per optimizer step.
        num_processes: Data-parallel processes.
        grads_averaged_across_processes: Whether the gradient reduction averages (DDP/FSDP) rather than sums.
    """
    if isinstance(global_trained_tokens, torch.Tensor):
        tokens = global_trained_tokens.clamp(min=1)
    else:
        tokens = max(global_trained_tokens, 1)
    denom = tokens * gradient_accumulation_steps
    return denom / num_processes if grads_averaged_across_processes else denom


def _up(x: torch.Tensor) -> torch.Tensor:
    """At least fp32: bf16 log-probs are too coarse for ratios near 1 (float64 inputs stay float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _masked_mean(values: torch.Tensor, mask: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.where(mask, values, 0.0).sum() / count.clamp(min=1)
    return torch.where(count > 0, mean, math.nan), count


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> tuple[torch.Tensor, torch.Tensor]:
    one = torch.ones((), device=values.device)
    if values.numel() == 0:
        return one * math.nan, one
    masked = torch.where(mask, values, -math.inf if largest else math.inf)
    ext = masked.amax() if largest else masked.amin()
    return torch.where(mask.any(), ext, math.nan), one


def _segment_count(index: torch.Tensor) -> int:
    """One more than the largest segment index (a host sync: callers that know the count pass it instead)."""
    return int(index.max()) + 1 if index.numel() else 0


def _segment_totals(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """[size] sums of ``values`` per segment ``index`` (no host sync; ``size`` above the largest index)."""
    return torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _per_sample_fraction_extreme(
    flags: torch.Tensor, mask: torch.Tensor, sample_index: torch.Tensor | None, largest: bool,
    num_samples: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Min/max over samples of the fraction of a sample's trained tokens that are flagged. ``num_samples`` (more
    than the largest index) keeps the device from a host sync; without it the size is read from the tensor."""
    if sample_index is None:
        count = mask.sum()
        frac = torch.where(mask, flags.float(), 0.0).sum() / count.clamp(min=1)
        return torch.where(count > 0, frac, math.nan), torch.ones((), device=flags.device)
    idx = sample_index[mask].long()
    if num_samples is None:
        num_samples = _segment_count(sample_index)
    tokens = _segment_totals(torch.ones_like(idx, dtype=torch.float), idx, num_samples)
    hits = _segment_totals(flags[mask].float(), idx, num_samples)
    present = tokens > 0
    frac = hits / tokens.clamp(min=1)
    return _masked_extreme(frac, present, largest)


def policy_loss_value(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    normalizer: float | torch.Tensor,
    *,
    clip_min: float = 0.5,
    clip_max: float = 5.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    score_centering: bool = True,
    top_logprobs: torch.Tensor | None = None,
    sampler_top_logprobs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The loss of :func:`policy_loss` alone (no metrics): a sum of per-token terms over the normaliser.

    Each token's term depends only on that token's log-probs, so the loss of a slice of tokens is this
    function of the slice (``trainer/fused_head.py`` takes the gradient chunk by chunk that way).
    """
    mask = loss_mask.bool()
    logp = _up(logprobs)
    adv = _up(advantages).detach()
    # Untrained positions may hold placeholders (e.g. sampler log-prob 0.0): pin their ratio to 1 so that exp()
    # cannot overflow and turn the zero gradient of a masked-out entry into NaN.
    log_ratio = torch.where(mask, logp - _up(sampler_logprobs).detach(), 0.0)
    ratio = torch.exp(log_ratio)  # [N], differentiable
    r = ratio.detach()
    in_range = in_bounds(r, clip_min, clip_max)
    keep = (mask & in_range).float()  # m_t of the module docstring, detached

    if score_centering:
        if top_logprobs is None or sampler_top_logprobs is None:
            raise ValueError("score_centering needs top_logprobs and sampler_top_logprobs ([N, K] tensors)")
        top_lp = _up(top_logprobs)
        s_top = _up(sampler_top_logprobs).detach()
        valid = torch.isfinite(s_top)
        r_top = torch.exp(top_lp.detach() - torch.where(valid, s_top, 0.0))
        keep_top = valid & in_bounds(r_top, clip_min, clip_max) & mask[:, None]
        # sum_v m_v pi(v): its gradient is sum_v mu(v) f(r_v) grad log pi(v). Select before exp() so padding
        # slots (any value, even NaN) get an exact zero gradient.
        centering = torch.exp(torch.where(keep_top, top_lp, -math.inf)).sum(dim=-1)  # [N]
        per_token = -adv * (keep * ratio - centering)
    else:
        clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
        per_token = -keep * torch.minimum(ratio * adv, clipped * adv)
    loss = torch.where(mask, per_token, 0.0).sum() / normalizer
    return loss


def policy_loss(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    normalizer: float | torch.Tensor,
    *,
    clip_min: float = 0.5,
    clip_max: float = 5.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    score_centering: bool = True,
    top_logprobs: torch.Tensor | None = None,
    sampler_top_logprobs: torch.Tensor | None = None,
    sample_index: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    num_samples: int | None = None,
) -> LossOutput:
    """Loss and metrics of one micro-batch from per-token tensors.

    Args:
        logprobs: [N] current log-probs of the sampled tokens (requires grad).
        sampler_logprobs: [N] sampler log-probs of the same tokens (the old policy).
        advantages: [N] advantage of each token's sample.
        loss_mask: [N] bool or 0/1, True on trained tokens.
        normalizer: Denominator of the summed loss (see `loss_normalizer`).
        clip_min: C_min of masked importance sampling (`vllm_importance_sampling_clip_min`).
        clip_max: C_max (`vllm_importance_sampling_clip_max`).
        epsilon_low: Lower trust-region epsilon (`epsilon`).
        epsilon_high: Upper trust-region epsilon (`epsilon_high`).
        score_centering: Score centering (True) or the clipped surrogate (False).
        top_logprobs: [N, K] current log-probs of the sampler's top-N token ids (requires grad); needed for score
            centering.
        sampler_top_logprobs: [N, K] sampler log-probs of those ids; -inf marks padding slots.
        sample_index: [N] index of each token's sample, for the per-completion `clip_ratio/low_min|high_max`.
        entropy: [N] predictive entropy per token, averaged into the `entropy` metric when given.
        num_samples: more than the largest `sample_index` (a packed row's sample count): no host sync then.

    Returns:
        `LossOutput` with the normalised loss and the loss metrics of docs/metrics.md.
    """
    loss = policy_loss_value(
        logprobs, sampler_logprobs, advantages, loss_mask, normalizer, clip_min=clip_min, clip_max=clip_max,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, score_centering=score_centering,
        top_logprobs=top_logprobs, sampler_top_logprobs=sampler_top_logprobs,
    )  # fmt: skip
    mask = loss_mask.bool()
    logp = _up(logprobs)
    adv = _up(advantages).detach()
    r = torch.exp(torch.where(mask, logp.detach() - _up(sampler_logprobs).detach(), 0.0))
    in_range = in_bounds(r, clip_min, clip_max)
    metrics = _loss_metrics(
        logp.detach(),
        _up(sampler_logprobs),
        r,
        adv,
        mask,
        in_range,
        epsilon_low,
        epsilon_high,
        score_centering,
        sample_index,
        num_samples,
    )
    count = mask.sum()
    if score_centering:
        s_top = _up(sampler_top_logprobs).detach()
        mass = torch.where(torch.isfinite(s_top), torch.exp(s_top), 0.0).sum(dim=-1)
        metrics["sampling/sampler_mass"] = _masked_mean(mass, mask, count)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(_up(entropy.detach()), mask, count)
    return LossOutput(loss=loss, metrics=metrics)


def _loss_metrics(
    logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    r: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    in_range: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    score_centering: bool,
    sample_index: torch.Tensor | None,
    num_samples: int | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Importance-sampling, masking and trust-region metrics over the trained tokens (before MIS masking)."""
    count = mask.sum()
    diff = (logp - sampler_logp).abs()
    low = r < 1.0 - epsilon_low
    high = r > 1.0 + epsilon_high
    if not score_centering:  # the clip only binds when it lowers the objective
        low = low & (adv < 0)
        high = high & (adv > 0)
    return {
        "sampling/sampling_logp_difference/mean": _masked_mean(diff, mask, count),
        "sampling/sampling_logp_difference/max": _masked_extreme(diff, mask, largest=True),
        "sampling/importance_sampling_ratio/min": _masked_extreme(r, mask, largest=False),
        "sampling/importance_sampling_ratio/mean": _masked_mean(r, mask, count),
        "sampling/importance_sampling_ratio/max": _masked_extreme(r, mask, largest=True),
        "sampling/masked_mean": _masked_mean((~in_range).float(), mask, count),
        "clip_ratio/low_mean": _masked_mean(low.float(), mask, count),
        "clip_ratio/low_min": _per_sample_fraction_extreme(low, mask, sample_index, False, num_samples),
        "clip_ratio/high_mean": _masked_mean(high.float(), mask, count),
        "clip_ratio/high_max": _per_sample_fraction_extreme(high, mask, sample_index, True, num_samples),
        "clip_ratio/region_mean": _masked_mean((low | high).float(), mask, count),
    }

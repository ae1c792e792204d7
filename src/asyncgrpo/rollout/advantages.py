"""Group advantages (R4), the zero-std drop (R5) and the reward metrics of a scored group.

Advantages are centred within the group and divided by the group's std unless `scale_rewards="none"` (Dr. GRPO).
Rollouts no source scored (NaN total) are left out of the mean and std and get advantage 0. Groups whose
scored rewards are all equal, or with fewer than two scored rollouts, carry no signal and are dropped; the
drop is decided from the rewards, never from the advantages, so a custom `compute_advantages` cannot
change it.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from asyncgrpo.metrics import MetricEvent

__all__ = ["group_advantages", "group_reward_metrics", "is_zero_std_group"]

# Bessel-corrected std (ddof=1), as torch.std and GRPO's group normalisation use.
STD_DDOF = 1


def _scored(rewards: np.ndarray) -> np.ndarray:
    return np.asarray(rewards, dtype=np.float64)[~np.isnan(np.asarray(rewards, dtype=np.float64))]


def is_zero_std_group(rewards: np.ndarray) -> bool:
    """True when the group carries no signal: fewer than two scored rollouts, or all scored rewards equal."""
    scored = _scored(rewards)
    return scored.size < 2 or bool(np.all(scored == scored[0]))


def group_advantages(rewards: np.ndarray, scale: bool = True) -> np.ndarray:
    """(r - mean) / std over the scored rollouts of one group; 0 for unscored ones (and for a zero-std group).

    Args:
        rewards: [G] total rewards, NaN where no source scored the rollout.
        scale: divide by the std; False leaves r - mean (Dr. GRPO: the std favours easy and hard prompts).

    Returns:
        [G] float64 advantages, in the order of `rewards`.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    advantages = np.zeros_like(rewards)
    if is_zero_std_group(rewards):
        return advantages
    scored = ~np.isnan(rewards)
    values = rewards[scored]
    centred = values - values.mean()
    advantages[scored] = centred / values.std(ddof=STD_DDOF) if scale else centred
    return advantages


def group_reward_metrics(
    rewards: np.ndarray,
    per_source: Mapping[str, np.ndarray],
    dropped: bool,
    num_samples: int | None = None,
) -> list[MetricEvent]:
    """Metric events of one scored group (weighted so that a window average is a per-completion mean).

    Args:
        rewards: [G] total rewards, NaN where unscored.
        per_source: Per reward source name (reward function name, or environment class name), its [G] rewards.
        dropped: Whether the group is dropped (zero std or fewer than two scored).
        num_samples: Trained samples the group yields (forks can make it exceed G); weights the `*group_std`
            metrics, which docs/metrics.md averages over trained samples. Defaults to G.

    Returns:
        `(name, value, weight)` events: reward, reward_kept or reward_dropped, reward_group_std,
        frac_reward_zero_std, rewards/{name}/mean and rewards/{name}/group_std.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    weight_samples = float(len(rewards) if num_samples is None else num_samples)
    events: list[MetricEvent] = [("frac_reward_zero_std", float(dropped), 1.0)]
    scored = _scored(rewards)
    if scored.size:
        mean = float(scored.mean())
        events.append(("reward", mean, float(scored.size)))
        events.append(("reward_dropped" if dropped else "reward_kept", mean, float(scored.size)))
    if not dropped:
        events.append(("reward_group_std", float(scored.std(ddof=STD_DDOF)), weight_samples))
    for name, values in per_source.items():
        source_scored = _scored(values)
        if source_scored.size:
            events.append((f"rewards/{name}/mean", float(source_scored.mean()), float(source_scored.size)))
        if not dropped and source_scored.size >= 2:
            events.append((f"rewards/{name}/group_std", float(source_scored.std(ddof=STD_DDOF)), weight_samples))
    return events

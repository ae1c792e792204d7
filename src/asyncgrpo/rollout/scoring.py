"""Scoring one finished group (R3-R5, M1) as a pure function of its rollouts and what its rewards returned.

The rollout loop runs the reward functions and the environments' ``get_reward`` (I/O, threads); everything after
that is here and touches nothing outside its arguments: total rewards, the user's ``compute_advantages``, the
zero-std drop, the training sequences (``reconcile.py``) and the group's metric events. So the arithmetic can be
checked by hand without a server or an event loop (``tests/unit/test_group_scoring.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncgrpo.metrics import MetricEvent
from asyncgrpo.rollout.advantages import group_reward_metrics, is_zero_std_group
from asyncgrpo.rollout.agents.stats import tool_metric_events
from asyncgrpo.rollout.completion_metrics import completion_metric_events
from asyncgrpo.rollout.reconcile import ReconcileStats, rollout_to_sequences
from asyncgrpo.rollout.records import finish_reason, tool_loop_stats
from asyncgrpo.rollout.rewards import total_rewards
from asyncgrpo.types import Rollout, RolloutGroup, TrainingSequence

__all__ = ["GroupOrigin", "ScoredGroup", "score_group", "trainable_samples"]


@dataclass(frozen=True)
class GroupOrigin:
    """Where a group comes from: its place in the run, its prompt's row and the policy it started under.

    Args:
        group_id: counted from 0 over the run.
        row_index: the prompt's row in the dataset.
        flat_index: the row counted over epochs (``epoch * len(dataset) + row``): checkpoints resume from it.
        epoch: the epoch the prompt was taken in.
        model_version: the policy version when the group started.
    """

    group_id: int
    row_index: int
    flat_index: int
    epoch: int
    model_version: int


@dataclass
class ScoredGroup:
    """A scored group: the record ``compute_advantages`` saw (``rewards`` set), one advantage per rollout,
    whether the group is dropped, each rollout's training sequences and the group's metric events."""

    group: RolloutGroup
    advantages: np.ndarray
    dropped: bool
    sequences: list[list[TrainingSequence]]
    events: list[MetricEvent]


def score_group(
    rollouts: list[Rollout],
    prompts: list[list[dict[str, Any]]],
    env_rewards: list[tuple[type, float] | None],
    per_func: np.ndarray,
    *,
    reward_names: list[str],
    reward_kwargs: dict[str, list[Any]],
    origin: GroupOrigin,
    num_sampler_logprobs: int | None,
    has_tools: bool,
    compute_advantages: Callable[[RolloutGroup], Any],
    queued_at: float = 0.0,
    fork_threshold_tokens: int = 0,
) -> ScoredGroup:
    """Score one group of G rollouts.

    Args:
        rollouts: the group's rollouts, in order.
        prompts: the prompt each rollout was generated for (an environment may have built it).
        env_rewards: per rollout, the environment's class and ``get_reward()``, or None.
        per_func: [G, F] what the F reward functions returned, NaN where one did not score.
        reward_names: the F reward functions' names (``rewards/<name>/*`` metrics).
        reward_kwargs: the row's other columns, one entry per rollout (handed on in the ``RolloutGroup``).
        has_tools: whether the run has tools; ``tools/*`` events only then (M1).
        compute_advantages: the loop's hook: ``RolloutGroup`` -> G advantages.
        queued_at: the group's ``RolloutGroup.queued_at``.
        fork_threshold_tokens: the reconciliation's realign threshold (``reconcile.py``).

    Raises:
        ValueError: ``compute_advantages`` returned something other than G values.
    """
    G = len(rollouts)
    stats = ReconcileStats()
    sequences = [
        rollout_to_sequences(
            r,
            group_id=origin.group_id,
            row_index=origin.flat_index,
            model_version=origin.model_version,
            num_sampler_logprobs=num_sampler_logprobs,
            stats=stats,
            fork_threshold_tokens=fork_threshold_tokens,
        )
        for r in rollouts
    ]
    group = RolloutGroup(
        prompts=prompts,
        reward_kwargs=reward_kwargs,
        completions=[r.completion for r in rollouts],
        completions_ids=[r.completion_ids for r in rollouts],
        completions_sequences=sequences,
        tool_call_counts=[r.tool_call_count for r in rollouts],
        tool_failure_counts=[r.tool_failure_count for r in rollouts],
        model_version=origin.model_version,
        group_id=origin.group_id,
        row_index=origin.row_index,
        env_rewards=env_rewards,
        rollout_rewards=[r.reward for r in rollouts],
        queued_at=queued_at,
    )
    group.rewards = total_rewards(per_func, [e and e[1] for e in env_rewards], group.rollout_rewards)
    advantages = np.asarray(compute_advantages(group), dtype=np.float64)
    if advantages.shape != (G,):
        raise ValueError(f"compute_advantages returned shape {advantages.shape}; expected ({G},)")
    dropped = is_zero_std_group(group.rewards)
    per_source = {name: per_func[:, j] for j, name in enumerate(reward_names)}
    for cls in {e[0] for e in env_rewards if e is not None}:  # rewards/<EnvClass>/mean
        per_source[cls.__name__] = np.array([e[1] if e and e[0] is cls else np.nan for e in env_rewards])
    num_samples = sum(len(seqs) for seqs in sequences)
    events = group_reward_metrics(group.rewards, per_source, dropped, num_samples)
    events += completion_metric_events(rollouts, [finish_reason(r) for r in rollouts])
    events += stats.metric_events(num_samples, G)
    if has_tools:
        fails = [r.tool_failure_count for r in rollouts]
        loop_stats = [tool_loop_stats(r) for r in rollouts]
        events += tool_metric_events([r.tool_call_count for r in rollouts], fails, loop_stats)
    return ScoredGroup(group, advantages, dropped, sequences, events)


def trainable_samples(scored: ScoredGroup) -> tuple[list[TrainingSequence], list[str]]:
    """The samples of a kept group, each carrying its rollout's advantage, and why any were left out: a sample
    that breaks its invariants (e.g. a sampled token outside its own candidate set) would train as NaN."""
    kept: list[TrainingSequence] = []
    problems: list[str] = []
    if scored.dropped:
        return kept, problems
    for seqs, adv in zip(scored.sequences, scored.advantages):
        for s in seqs:
            s.advantage = float(adv)
            try:
                s.validate()
            except ValueError as e:
                problems.append(str(e))
                continue
            kept.append(s)
    return kept, problems

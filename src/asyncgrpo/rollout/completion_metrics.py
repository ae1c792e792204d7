"""The ``completions/*`` and per-rollout ``rollout/*`` metrics of one finished group (M1).

Means are recorded with weight = the number of items they average (metrics.py), so a
logging window reports the mean over all its rollouts, not over its groups.
"""

from __future__ import annotations

from asyncgrpo.metrics import MetricEvent
from asyncgrpo.types import Rollout


def completion_metric_events(rollouts: list[Rollout], finish_reasons: list[str]) -> list[MetricEvent]:
    """Length, truncation, duplicate, turn and tool-call metrics of a group.

    Args:
        rollouts: the group's rollouts.
        finish_reasons: each rollout's last finish reason as the server gave it (``"stop"``: ended with EOS).
    """
    if not rollouts or len(rollouts) != len(finish_reasons):
        raise ValueError(f"need one finish reason per rollout, got {len(finish_reasons)} for {len(rollouts)} rollouts")
    n = float(len(rollouts))
    lengths = [len(r.completion_ids) for r in rollouts]
    events: list[MetricEvent] = [
        ("completions/mean_length", sum(lengths) / n, n),
        ("completions/max_length", float(max(lengths)), 1.0),
        ("completions/min_length", float(min(lengths)), 1.0),
    ]
    terminated = [length for length, f in zip(lengths, finish_reasons) if f == "stop"]
    if terminated:
        events += [
            ("completions/mean_terminated_length", sum(terminated) / len(terminated), float(len(terminated))),
            ("completions/max_terminated_length", float(max(terminated)), 1.0),
            ("completions/min_terminated_length", float(min(terminated)), 1.0),
        ]
    seen: set[tuple[int, ...]] = set()
    duplicates = 0
    for r in rollouts:
        key = tuple(r.completion_ids)
        duplicates += key in seen
        seen.add(key)
    turns = [len(r.turns) for r in rollouts]
    events += [
        ("completions/clipped_ratio", sum(f != "stop" for f in finish_reasons) / n, n),
        ("completions/duplicate_frac", duplicates / n, n),
        ("rollout/turns_mean", sum(turns) / n, n),
        ("rollout/turns_max", float(max(turns)), 1.0),
    ]
    return events

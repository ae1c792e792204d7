"""Tool-loop bookkeeping of one rollout and the ``tools/`` metric events of a group (M1).

Names and meanings follow the reference (M1 in docs/spec.md, listed in docs/metrics.md): call and failure rates
over all rollouts (dropped groups included), per-tool latency and counts, unknown names (a policy error, unlike a
tool that raised), calls per calling assistant message, and the fraction of rollouts stopped at
``max_tool_calling_iterations``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from asyncgrpo.metrics import MetricEvent

__all__ = ["ToolLoopStats", "tool_metric_events"]


@dataclass
class ToolLoopStats:
    """What the tool loop saw in one rollout.

    Args:
        calls: ``(tool name, failed, seconds)`` of each executed call of a known tool.
        unknown_names: calls to a name no tool has.
        malformed: calls whose JSON could not be read.
        parallel: for each assistant message that called tools, how many calls it made.
        exhausted: stopped at ``max_tool_calling_iterations`` while the model was still calling.
    """

    calls: list[tuple[str, bool, float]] = field(default_factory=list)
    unknown_names: int = 0
    malformed: int = 0
    parallel: list[int] = field(default_factory=list)
    exhausted: bool = False


def tool_metric_events(
    call_counts: list[int], failure_counts: list[int], stats: list[ToolLoopStats | None]
) -> list[MetricEvent]:
    """The group's ``tools/`` events; ``call_counts``/``failure_counts`` are the rollouts' own counts.

    A rollout produced by a custom ``generate_one`` has no ``ToolLoopStats``: it still counts in the
    call/failure rates and as not exhausted.
    """
    g = len(call_counts)
    calls, failures = sum(call_counts), sum(failure_counts)
    events: list[MetricEvent] = [
        ("tools/call_frequency", calls / g, float(g)),
        ("tools/failure_frequency", failures / calls if calls else math.nan, float(calls)),
        ("tools/loop_exhausted_frac", sum(bool(s and s.exhausted) for s in stats) / g, float(g)),
        ("tools/unknown_name_count", float(sum(s.unknown_names for s in stats if s)), 1.0),
    ]
    per_tool: dict[str, list[tuple[bool, float]]] = defaultdict(list)
    parallel: list[int] = []
    for s in stats:
        if s is None:
            continue
        parallel += s.parallel
        for name, failed, seconds in s.calls:
            per_tool[name].append((failed, seconds))
    if parallel:
        events.append(("tools/parallel_calls_mean", sum(parallel) / len(parallel), float(len(parallel))))
    all_latencies = [sec for results in per_tool.values() for _, sec in results]
    if all_latencies:
        events.append(("tools/latency_s", sum(all_latencies) / len(all_latencies), float(len(all_latencies))))
    for name, results in sorted(per_tool.items()):
        n = len(results)
        events.append((f"tools/{name}/latency_s", sum(sec for _, sec in results) / n, float(n)))
        events.append((f"tools/{name}/call_count", float(n), 1.0))
        events.append((f"tools/{name}/failure_count", float(sum(f for f, _ in results)), 1.0))
    return events

"""The rollout loop's own records: a turn with the server's finish reason, a rollout with its tool-loop stats.

The hooks hand the machinery a ``TurnRecord`` (``generate_one_turn``) and a ``Rollout`` (``generate_one``), whose
fields follow the reference exactly (T9 in docs/spec.md). What the group's metrics also need rides on these
subclasses, which are still a ``TurnRecord`` and a ``Rollout`` to every hook: the finish reason of a request
(``completions/*``) and what the built-in tool loop saw (``tools/*``). A turn or rollout built by custom code is a
plain record and reads as "stopped" and "no tool-loop stats", as it always did.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from asyncgrpo.rollout.agents.stats import ToolLoopStats
from asyncgrpo.types import Rollout, RoutedTurn

__all__ = ["SampledTurn", "ToolLoopRollout", "finish_reason", "tool_loop_stats"]


@dataclass
class SampledTurn(RoutedTurn):
    """A turn the loop sampled, with the server's ``finish_reason`` (``"stop"``: EOS or a stop string,
    ``"length"``: the token limit) and, under MoE routing replay, the server's routing (``RoutedTurn``)."""

    finish_reason: str = "stop"


@dataclass
class ToolLoopRollout(Rollout):
    """A rollout of the built-in tool loop, with what the loop saw (the group's ``tools/*`` metrics)."""

    tool_loop_stats: ToolLoopStats | None = None

    @classmethod
    def of(cls, rollout: Rollout, stats: ToolLoopStats) -> ToolLoopRollout:
        """``rollout`` with ``stats`` attached (same fields, same ``rollout_id``)."""
        fields = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(Rollout)}
        return cls(**fields, tool_loop_stats=stats)


def finish_reason(rollout: Rollout) -> str:
    """The finish reason of the rollout's last turn; ``"stop"`` when no turn says (counted as not clipped)."""
    last = rollout.turns[-1] if rollout.turns else None
    return last.finish_reason if isinstance(last, SampledTurn) else "stop"


def tool_loop_stats(rollout: Rollout) -> ToolLoopStats | None:
    """What the built-in tool loop saw in ``rollout``; None for a rollout of custom code."""
    return rollout.tool_loop_stats if isinstance(rollout, ToolLoopRollout) else None

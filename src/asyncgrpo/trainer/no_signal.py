"""Why a step gets no trainable group: the likely cause, named in the trainer's waiting line (issue 30).

A step waits while groups arrive but every one is dropped (all its rewards equal), or while none arrives.
The causes look alike from the queue but need different fixes, so they are told apart in this order:

1. a dead server: a server of the run does not answer ``/health`` (never call that a reward problem);
2. no tool calls: the run has tools and not one completion called one (the model does not know the format);
3. a constant reward: every completion of every group scored the same value;
4. saturated groups: each group ties on its own value (prompts too easy or too hard for the policy).
"""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

HEALTH_TIMEOUT_S = 2.0  # one /health call while diagnosing; a live server answers in milliseconds
# Tied groups needed before a reward cause is named: one group of 8 all scoring 0 happens by chance (a policy right
# 25 % of the time ties a group of 8 at 0 one time in 10); two in a row, one time in 100. A whole group without a
# single tool call is specific enough on its own (the agent runs where this matters take ~30 s a group on a CPU).
MIN_TIED_GROUPS = 2


def unanswering(base_urls: Sequence[str], timeout: float = HEALTH_TIMEOUT_S) -> list[str]:
    """The servers among ``base_urls`` whose ``GET /health`` gives no 200 within ``timeout`` seconds."""
    dead = []
    for url in base_urls:
        try:
            with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as r:
                if r.status == 200:
                    continue
        except (urllib.error.URLError, OSError):
            pass
        dead.append(url)
    return dead


@dataclass
class StepGroups:
    """What one step's scored groups showed so far (reset when a step starts)."""

    scored: int = 0
    dropped: int = 0
    tool_groups: int = 0  # groups of a run with tools (their completions could call one)
    tool_calls: int = 0  # tool calls over those groups
    dropped_values: set[float] = field(default_factory=set)  # the distinct rewards of dropped groups

    def add(self, dropped: bool, rewards: Iterable[float] | None, tool_calls: int | None) -> None:
        self.scored += 1
        if tool_calls is not None:
            self.tool_groups += 1
            self.tool_calls += tool_calls
        if dropped:
            self.dropped += 1
            self.dropped_values.update(round(r, 6) for r in rewards or () if math.isfinite(r))

    @property
    def no_signal(self) -> bool:
        """Groups were scored and every one was dropped for equal rewards."""
        return self.scored > 0 and self.dropped == self.scored


def likely_cause(groups: StepGroups, dead_servers: Sequence[str]) -> str:
    """One sentence naming the likely cause of a step without trainable groups, and what to change ('' if the
    step is simply waiting for groups still being generated)."""
    if dead_servers:
        return (
            f"the generation server {', '.join(dead_servers)} does not answer /health: it died or is restarting (not "
            "a reward problem); restart it on the same address (the run retries for vllm_server_restart_timeout)"
        )
    if not groups.no_signal:
        return ""
    if groups.tool_groups and groups.tool_calls == 0:
        return (
            f"no completion of the {groups.tool_groups} groups called a tool: the model does not write tool calls "
            "yet. Warm it up first (asyncgrpo.assets.tool_warmup.supervised_tool_warmup, as "
            "examples/agent_calculator.py does)"
        )
    if groups.scored < MIN_TIED_GROUPS:
        return ""
    values = sorted(groups.dropped_values)
    if len(values) == 1:
        return (
            f"every completion scored {values[0]:g}: the reward is constant. Check that reward_funcs can tell "
            "completions apart (read a few with log_completions=True), or use easier prompts"
        )
    shown = ", ".join(f"{v:g}" for v in values[:5])
    return (
        f"each group's completions tie (group rewards {shown}): the prompts are too easy or too hard for the policy. "
        "Raise num_generations or temperature for more varied completions, or change the prompts"
    )

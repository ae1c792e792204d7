"""MoE routing replay in the rollout: which prompt rows to ask the server for, and a turn's routing.

A server started with ``--enable-return-routed-experts`` answers each request with the expert ids of every token
it forwarded, prompt included (``asyncgrpo/routed_experts.py``). A rollout's later turn re-sends the conversation
so far; it asks only for rows it does not hold (vLLM's ``routed_experts_prompt_start``): its previous turn
returned rows for every token but its last sampled one, so the new turn starts there, and its rows cover that
token, the tool result and template glue (routed by this turn's prefill, the K/V the sampler attended to) and
its own output. A prompt that does not extend the previous turn (a re-rendered history: reconciliation forks)
asks for every row. What the rollout has seen lives in a context variable: each rollout runs in its own task.
"""

from __future__ import annotations

import contextvars
from typing import Any

# prompt + output of the rollout's previous turn (None before its first)
_PREVIOUS: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("asyncgrpo_routed", default=None)


def prompt_start(prompt_ids: list[int]) -> int:
    """``routed_experts_prompt_start`` for a turn of this rollout sending ``prompt_ids``."""
    previous = _PREVIOUS.get()
    if previous and len(previous) <= len(prompt_ids) and tuple(prompt_ids[: len(previous)]) == previous:
        return len(previous) - 1
    return 0


def turn_routing(prompt_ids: list[int], result: Any) -> dict[str, Any]:
    """The ``TurnRecord`` fields of an answer's routing, and remember the turn for the rollout's next request.

    Raises:
        RuntimeError: the server returned no routing although the run asked for it.
    """
    routed = result.routed_experts
    if routed is None:
        raise RuntimeError(
            "the generation server returned no routed_experts although router replay asked for them: start it "
            "with --enable-return-routed-experts"
        )
    _PREVIOUS.set(tuple(prompt_ids) + tuple(result.token_ids))
    start = len(prompt_ids) + len(result.token_ids) - 1 - len(routed)  # rows from the request's prompt start on
    return {"routed_experts": routed, "routed_experts_start": start}

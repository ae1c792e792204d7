"""The multi-turn tool loop (A2): render, generate, parse, call, append, until the model stops calling.

Each turn renders the whole conversation with the chat template (the tools' schemas included), samples one
assistant message, parses its ``<tool_call>`` blocks and runs them in the order written (sync tools in the
worker's thread pool, so a slow one blocks only its own rollout). Results go back as ``tool`` messages; an
unknown name, malformed JSON or a raising tool becomes an error message the model sees, counted as a failed
call. The loop ends on a turn without calls, or on the call turn after ``max_tool_calling_iterations`` executed
ones (that turn's calls are not run: the rollout counts as exhausted). Only sampled tokens are trained: the tool
messages reach the sequence as prompt tokens of the next turn (loss mask 0).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from asyncgrpo.rollout.agents.parsing import parse_tool_calls
from asyncgrpo.rollout.agents.stats import ToolLoopStats
from asyncgrpo.rollout.agents.tools import execute_tool, tool_names, tool_schema, underlying_function
from asyncgrpo.types import Rollout, TurnRecord

__all__ = ["ToolLoopSettings", "run_tool_loop", "schemas_of"]

_SCHEMAS: dict[Any, dict[str, Any]] = {}  # function -> schema; env instances share their class's functions


def schemas_of(tools: list[Callable[..., Any]]) -> list[dict[str, Any]]:
    """JSON schemas of ``tools`` (cached per underlying function)."""
    out = []
    for t in tools:
        key = underlying_function(t)
        if key not in _SCHEMAS:
            _SCHEMAS[key] = tool_schema(t)
        out.append(_SCHEMAS[key])
    return out


@dataclass(frozen=True)
class ToolLoopSettings:
    """Limits of the tool loop: ``max_iterations`` executed call turns (None: no limit), the server's context."""

    max_iterations: int | None
    max_model_len: int


async def run_tool_loop(
    prompt: list[dict[str, Any]],
    tools: list[Callable[..., Any]],
    *,
    render: Callable[[list[dict[str, Any]], list[dict[str, Any]]], list[int]],
    generate_turn: Callable[[list[int]], Awaitable[TurnRecord]],
    decode: Callable[[list[int]], str],
    executor: Executor | None,
    settings: ToolLoopSettings,
) -> tuple[Rollout, ToolLoopStats]:
    """One rollout of ``prompt`` with ``tools``.

    Args:
        render: conversation + tool schemas -> prompt token ids (the chat template, generation prompt added).
        generate_turn: one sampling request (``AsyncRolloutLoop.generate_one_turn``).
        decode: token ids -> text (special tokens dropped).
        executor: the thread pool sync tools run in.
    """
    registry = dict(zip(tool_names(tools), tools))
    schemas = schemas_of(tools)
    available = ", ".join(registry) or "none"
    messages = [dict(m) for m in prompt]
    completion: list[dict[str, Any]] = []
    turns: list[TurnRecord] = []
    stats = ToolLoopStats()
    call_count = failure_count = call_turns = 0
    while True:
        prompt_ids = render(messages, schemas)
        if turns and len(prompt_ids) >= settings.max_model_len:
            break  # the conversation outgrew the server's context: end the rollout here
        turn = await generate_turn(prompt_ids)
        turns.append(turn)
        message = {"role": "assistant", "content": decode(turn.output_ids)}
        messages.append(message)
        completion.append(message)
        calls = parse_tool_calls(message["content"]) if registry else []
        if not calls:
            break
        if settings.max_iterations is not None and call_turns >= settings.max_iterations:
            stats.exhausted = True
            break
        call_turns += 1
        stats.parallel.append(len(calls))
        for call in calls:  # in the order the model wrote them
            call_count += 1
            if call.error is not None:
                stats.malformed += 1
                failure_count += 1
                content = f"Error: {call.error}"
            elif call.name not in registry:
                stats.unknown_names += 1
                failure_count += 1
                content = f"Error: there is no tool named {call.name!r}; the available tools are: {available}"
            else:
                result = await execute_tool(registry[call.name], call.arguments, executor)
                stats.calls.append((call.name, result.failed, result.latency_s))
                failure_count += result.failed
                content = result.content
            tool_message = {"role": "tool", "name": call.name, "content": content}
            messages.append(tool_message)
            completion.append(tool_message)
    rollout = Rollout(
        completion=completion,
        completion_ids=[t for turn in turns for t in turn.output_ids],
        turns=turns,
        tool_call_count=call_count,
        tool_failure_count=failure_count,
    )
    return rollout, stats

"""Tools the policy may call (A1): validation, JSON schemas, and one call's execution.

A tool is a typed, Google-style-documented function (sync or ``async def``). Its JSON schema comes from
transformers' own ``get_json_schema``, the same machinery ``apply_chat_template(tools=...)`` uses, so the model
sees exactly what the chat template would show it. Tools are registered under ``__name__`` and cross into the
spawned rollout worker by pickling, hence the module-level requirement checked by ``check_tool``.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from asyncgrpo.rollout.rewards import check_picklable

__all__ = ["RESERVED_ENV_METHODS", "ToolResult", "check_tool", "environment_tools", "execute_tool", "tool_schema"]

# Environment methods with a lifecycle role; every other public method of an environment is a tool.
RESERVED_ENV_METHODS = frozenset({"reset", "get_reward"})


def underlying_function(func: Any) -> Any:
    """The plain function behind a partial or a bound method (its name is the tool's name)."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__func__", func)  # a bound method's function


def tool_schema(func: Callable[..., Any]) -> dict[str, Any]:
    """The ``{"type": "function", "function": {...}}`` schema transformers builds from hints and docstring.

    Raises:
        TypeError: the function lacks type hints or a Google-style docstring (the message says what to add).
    """
    from transformers.utils import get_json_schema

    name = getattr(underlying_function(func), "__name__", type(func).__name__)
    try:
        return get_json_schema(func)
    except Exception as exc:  # transformers raises its own TypeChecking/DocstringParsing errors
        raise TypeError(
            f"tool {name!r}: cannot build its JSON schema ({type(exc).__name__}: {exc}). A tool needs type hints on "
            "every argument and a Google-style docstring with a description and an `Args:` entry per argument, e.g.\n"
            '    def multiply(a: int, b: int) -> int:\n        """Multiplies two integers.\n\n        Args:\n'
            '            a: The first integer.\n            b: The second integer.\n        """'
        ) from exc


def check_tool(func: Any) -> dict[str, Any]:
    """Validate one entry of ``tools=[...]`` and return its schema.

    Raises:
        TypeError: not callable, a lambda, a closure, unpicklable, or without schema; the message says the fix.
    """
    if not callable(func):
        raise TypeError(f"tools entries must be functions, got {type(func).__name__} {func!r}")
    target = underlying_function(func)
    name = getattr(target, "__name__", None)
    qualname = getattr(target, "__qualname__", "") or ""
    if name is None or isinstance(func, functools.partial) or not inspect.isfunction(target):
        raise TypeError(
            f"tool {func!r} has no function name to register it under: tools are registered by `__name__`, so pass "
            "a function defined with `def` at the top level of a module (not a callable object or a partial)"
        )
    if name == "<lambda>" or "<locals>" in qualname:
        kind = "a lambda" if name == "<lambda>" else "a closure (defined inside another function)"
        raise TypeError(
            f"tool {qualname!r} is {kind}. Tools cross into the spawned rollout worker by pickling and are called "
            "by name: define it with `def` at the top level of a module and pass that function"
        )
    check_picklable(func, "tool")
    return tool_schema(func)


def environment_tools(env: Any) -> list[Callable[..., Any]]:
    """The public methods of an environment instance, bound, in name order (``reset``/``get_reward`` excluded)."""
    out = []
    for name in sorted(dir(type(env))):
        if name.startswith("_") or name in RESERVED_ENV_METHODS:
            continue
        member = getattr(env, name, None)
        if inspect.ismethod(member) or (callable(member) and inspect.iscoroutinefunction(member)):
            out.append(member)
    return out


def is_async_callable(func: Any) -> bool:
    """Whether calling ``func`` returns a coroutine (``async def``, also through partials and bound methods)."""
    target = underlying_function(func)
    call = type(func).__call__ if callable(func) else None
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(call)


async def call_maybe_async(func: Callable[..., Any], kwargs: dict[str, Any], executor: Executor | None) -> Any:
    """Await an async callable; run a sync one in ``executor`` so a slow call does not stall the event loop."""
    if is_async_callable(func):
        return await func(**kwargs)
    result = await asyncio.get_running_loop().run_in_executor(executor, functools.partial(func, **kwargs))
    if inspect.isawaitable(result):
        result = await result
    return result


@dataclass
class ToolResult:
    """Outcome of one tool call: the tool message content, whether it failed, and how long it ran."""

    content: str
    failed: bool
    latency_s: float


def _stringify(value: Any) -> str:
    if isinstance(value, str):
        return value
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


async def execute_tool(func: Callable[..., Any], arguments: dict[str, Any], executor: Executor | None) -> ToolResult:
    """Run one call; an exception becomes an error message for the model (counted as a failure), never a crash."""
    t0 = time.perf_counter()
    try:
        value = await call_maybe_async(func, arguments, executor)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's feedback
        return ToolResult(f"Error: {type(exc).__name__}: {exc}", True, time.perf_counter() - t0)
    return ToolResult(_stringify(value), False, time.perf_counter() - t0)


def tool_names(tools: Sequence[Callable[..., Any]]) -> list[str]:
    """Registration names (``__name__``); duplicates are an error because the model calls tools by name."""
    names = [underlying_function(t).__name__ for t in tools]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"two tools share the name(s) {dup}; tools are called by name, rename one of them")
    return names

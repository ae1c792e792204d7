"""Reward functions: run them concurrently for one group, and sum all reward sources (R1-R3).

Sync functions run in threads and `async def` ones are awaited together on the worker's event loop, so
their latencies overlap. Reward functions cross into the spawned rollout worker by pickling, so
`check_picklable` rejects lambdas and closures up front with a message that says what to use instead.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
import pickle
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "RewardFunctionError",
    "check_picklable",
    "check_reward_signature",
    "dataset_columns",
    "reward_function_name",
    "run_reward_functions",
    "total_rewards",
]

RewardFunc = Callable[..., Any]  # returns list[float | None], or an awaitable of it
_RESERVED_KWARGS = ("prompts", "completions", "completion_ids")


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names it, the original exception is the cause."""


def reward_function_name(func: Any) -> str:
    """Name used in errors and in `rewards/{name}/...` metrics: the function's, the partial's target's or the class's."""
    while isinstance(func, functools.partial):
        func = func.func
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) else type(func).__name__


def check_reward_signature(func: Any, columns: Sequence[str] | None) -> None:
    """Refuse, at trainer construction, a reward function that its first call would fail on (R1).

    Every call passes ``prompts``, ``completions``, ``completion_ids`` and every dataset column but ``prompt`` as
    keywords. ``columns`` are the dataset's columns (None: unknown, e.g. a streaming dataset; then only the
    keywords every call passes are checked).

    Raises:
        TypeError: a required parameter no call fills, or a keyword every call passes that the function refuses.
    """
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: nothing to check
        return
    name = reward_function_name(func)
    passed = set(_RESERVED_KWARGS) | {c for c in (columns or ()) if c != "prompt"}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    known = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    problems = []
    for p in params:
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        if required and (p.kind is p.POSITIONAL_ONLY or (columns is not None and p.name not in passed)):
            problems.append(f"its parameter {p.name!r} is never passed")
    refused = sorted((passed if columns is not None else set(_RESERVED_KWARGS)) - known) if not takes_any else []
    if refused:
        problems.append(f"it does not accept the keyword(s) {', '.join(refused)} that every call passes")
    if problems:
        cols = ", ".join(sorted(passed - set(_RESERVED_KWARGS))) or "none"
        raise TypeError(
            f"reward function {name!r}: {'; '.join(problems)}. Each call passes prompts, completions, completion_ids "
            f"and the dataset's columns by keyword (here: {cols}); write it as "
            f"`def {name}(completions, **kwargs)` and name the columns it needs, e.g. `(completions, answer, **kwargs)`"
        )


def dataset_columns(dataset: Any) -> list[str] | None:
    """The column names of a ``datasets.Dataset`` or a list of dict rows (None when unknown: no rows, streaming)."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list):
        return names
    if isinstance(dataset, Sequence) and dataset and isinstance(dataset[0], Mapping):
        return list(dataset[0])
    return None


def check_picklable(obj: Any, what: str) -> None:
    """Raise `TypeError` if `obj` cannot cross into the spawned rollout worker.

    Args:
        obj: A reward function, tool, environment factory or any object sent to the worker.
        what: What it is, for the message (e.g. "reward function").

    Raises:
        TypeError: `obj` (or something it refers to) does not pickle, or it lives in an interactive `__main__`
            the worker cannot re-import.
    """
    name = reward_function_name(obj)
    advice = (
        "The rollout worker is a spawned process, so it must be picklable: use a function defined with `def` at the "
        "top level of a module, a functools.partial of one, or an instance of a module-level class. Lambdas and "
        "closures (functions defined inside another function) cannot be pickled."
    )
    try:
        pickle.dumps(obj)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(f"{what} {name!r} cannot be pickled ({exc}). {advice}") from exc
    target = obj.func if isinstance(obj, functools.partial) else obj
    main = sys.modules.get("__main__")
    if getattr(target, "__module__", None) == "__main__" and not hasattr(main, "__file__"):
        raise TypeError(
            f"{what} {name!r} is defined in an interactive session, which the spawned rollout worker cannot "
            "re-import. Move it into a .py module and import it from there."
        )


def _is_async(func: Any) -> bool:
    while isinstance(func, functools.partial):
        func = func.func
    # A callable class instance with `async def __call__` is async too.
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


async def _call(func: RewardFunc, kwargs: dict[str, Any], executor: Executor | None) -> Any:
    if _is_async(func):
        return await func(**kwargs)
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(executor, functools.partial(func, **kwargs))
    if inspect.isawaitable(result):  # a sync-looking callable that returned a coroutine
        result = await result
    return result


def _to_column(name: str, result: Any, expected: int) -> np.ndarray:
    """Check one function's output and turn it into floats, NaN for `None` (and for NaN itself)."""
    if isinstance(result, np.ndarray):
        result = result.tolist()
    if not isinstance(result, (list, tuple)):
        raise TypeError(f"reward function {name!r} returned {type(result).__name__}; it must return a list of floats")
    if len(result) != expected:
        raise ValueError(
            f"reward function {name!r} returned {len(result)} rewards for {expected} completions; "
            "return one float (or None) per completion"
        )
    column = np.full(expected, np.nan, dtype=np.float64)
    for i, value in enumerate(result):
        if value is None:
            continue
        if not isinstance(value, numbers.Real):
            raise TypeError(f"reward function {name!r} returned {value!r} at index {i}; rewards must be floats or None")
        column[i] = float(value)
    return column


async def run_reward_functions(
    reward_funcs: Sequence[RewardFunc],
    *,
    prompts: list[Any],
    completions: list[list[dict[str, Any]]],
    completion_ids: list[list[int]],
    reward_kwargs: Mapping[str, list[Any]] | None = None,
    executor: Executor | None = None,
) -> np.ndarray:
    """Score one group with every reward function, all running at once.

    Args:
        reward_funcs: Sync callables or `async def` coroutine functions returning one float or `None` per completion.
        prompts: Prompt of each rollout (conversational message lists).
        completions: Completion messages of each rollout.
        completion_ids: Completion token ids of each rollout.
        reward_kwargs: The other dataset columns (`prompt` excluded), one list entry per rollout.
        executor: Thread pool for sync functions; the event loop's default one when `None`.

    Returns:
        Array [num_completions, num_funcs] of float64, NaN where a function returned `None`.

    Raises:
        RewardFunctionError: a function raised (the first failure in `reward_funcs` order is reported).
        ValueError, TypeError: a function returned the wrong number or type of values, or a dataset column name
            collides with a reserved keyword.
    """
    extra = {k: v for k, v in (reward_kwargs or {}).items() if k != "prompt"}
    clash = sorted(set(extra) & set(_RESERVED_KWARGS))
    if clash:
        raise ValueError(f"dataset column(s) {clash} clash with reward function keywords; rename the column(s)")
    kwargs = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **extra}
    n = len(completions)
    results = await asyncio.gather(*(_call(f, kwargs, executor) for f in reward_funcs), return_exceptions=True)
    columns = []
    for func, result in zip(reward_funcs, results):
        name = reward_function_name(func)
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):  # KeyboardInterrupt, CancelledError: not the function's fault
                raise result
            raise RewardFunctionError(f"reward function {name!r} raised {type(result).__name__}: {result}") from result
        columns.append(_to_column(name, result, n))
    if not columns:
        return np.empty((n, 0), dtype=np.float64)
    return np.stack(columns, axis=1)


def total_rewards(
    per_function: np.ndarray,
    env_rewards: Sequence[float | None] | None = None,
    rollout_rewards: Sequence[float | None] | None = None,
) -> np.ndarray:
    """Sum every reward source with weight 1 (R3): reward functions, environment `get_reward`, `Rollout.reward`.

    Args:
        per_function: [G, F] rewards of the reward functions, NaN where a function did not score.
        env_rewards: Per rollout, the environment's reward or `None`.
        rollout_rewards: Per rollout, `Rollout.reward` or `None`.

    Returns:
        [G] totals; NaN where no source scored the rollout.
    """
    g = per_function.shape[0]
    parts = [per_function]
    for extra in (env_rewards, rollout_rewards):
        if extra is not None:
            if len(extra) != g:
                raise ValueError(f"got {len(extra)} per-rollout rewards for {g} rollouts")
            parts.append(np.array([np.nan if v is None else float(v) for v in extra], dtype=np.float64)[:, None])
    stacked = np.concatenate(parts, axis=1) if parts else np.empty((g, 0))
    scored = ~np.isnan(stacked)
    totals = np.where(scored, stacked, 0.0).sum(axis=1)
    return np.where(scored.any(axis=1), totals, math.nan)

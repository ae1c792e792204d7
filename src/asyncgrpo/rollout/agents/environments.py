"""Environments (A4): validation of ``environment_factory``, routing, and the per-rollout instance pool.

An environment is a stateful object whose public methods are tools; ``reset(**row)`` starts an episode and
may return the prompt, the optional ``get_reward()`` scores it. One instance serves one live rollout at a time:
the pool hands out a free instance (creating one only when all are busy, so at most one per concurrent
rollout exists) and takes it back when the rollout ends, so an expensive ``__init__`` is paid once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from asyncgrpo.rollout.agents.tools import RESERVED_ENV_METHODS, check_tool, environment_tools
from asyncgrpo.rollout.rewards import check_picklable

__all__ = [
    "ENVIRONMENT_COLUMN",
    "EnvironmentPool",
    "EnvironmentRows",
    "check_environment_factory",
    "env_prompt",
    "reset_kwargs",
]

ENVIRONMENT_COLUMN = "environment"  # routes a row to one factory of a dict; consumed, never passed to reset
SELF_SAMPLED_ROWS = 1_000_000  # rows of the placeholder dataset when the environment owns the data


def check_environment_factory(
    factory: Any, must_pickle: bool = True, what_name: str = "environment_factory"
) -> dict[str, Callable[[], Any]]:
    """Validate ``environment_factory`` (a callable or a dict name -> callable) and return it as a dict.

    A single callable is stored under the name ``""``. Factories that are classes are checked
    further here: ``reset`` must exist and every public method must be a valid tool (hints and docstring).

    Args:
        must_pickle: the factories cross into the spawned rollout worker (training); an evaluation builds its
            environments in its own process and passes False.
        what_name: how errors name the argument (an eval set's ``environment_factory`` names its set).

    Raises:
        TypeError: a factory is not callable, does not pickle, or a class lacks ``reset`` / has a bad tool.
    """
    factories = dict(factory) if isinstance(factory, Mapping) else {"": factory}
    if not factories:
        raise ValueError(f"{what_name} is an empty dict; map at least one environment name to a factory")
    for name, f in factories.items():
        what = f"{what_name}[{name!r}]" if name else what_name
        if not isinstance(name, str):
            raise TypeError(f"{what_name} keys must be strings (the `environment` column values), got {name!r}")
        if not callable(f):
            raise TypeError(f"{what} must be a class or a function returning an environment, got {f!r}")
        if must_pickle:
            check_picklable(f, what)
        if inspect.isclass(f):
            if not callable(getattr(f, "reset", None)):
                raise TypeError(
                    f"{what} {f.__name__} has no reset() method; define reset(self, **kwargs) -> str | None"
                )
            for meth in _class_tools(f):
                try:
                    check_tool(meth)
                except TypeError as exc:
                    raise TypeError(f"{f.__name__}.{meth.__name__} is exposed as a tool: {exc}") from exc
    return factories


def _class_tools(cls: type) -> list[Callable[..., Any]]:
    return [
        getattr(cls, n)
        for n in sorted(dir(cls))
        if not n.startswith("_") and n not in RESERVED_ENV_METHODS and inspect.isfunction(getattr(cls, n, None))
    ]


class EnvironmentRows:
    """The dataset of a run whose environment owns the data: rows without columns; ``reset`` makes each task."""

    def __init__(self, n: int = SELF_SAMPLED_ROWS) -> None:
        self._n = n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self._n:
            raise IndexError(i)
        return {}


def route(row: Mapping[str, Any], factories: Mapping[str, Any]) -> str:
    """The factory name for ``row``: its ``environment`` column for a dict, ``""`` for a single factory."""
    if list(factories) == [""]:
        return ""
    name = row.get(ENVIRONMENT_COLUMN)
    if name not in factories:
        raise ValueError(
            f"dataset row has environment={name!r}; with environment_factory as a dict every row needs an "
            f"'{ENVIRONMENT_COLUMN}' column naming one of {sorted(factories)}"
        )
    return name


def reset_kwargs(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row's columns as ``reset`` keywords; the routing column is the trainer's and is not passed."""
    return {k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN}


def env_prompt(prompt: list[dict[str, Any]] | None, observation: Any, env_name: str) -> list[dict[str, Any]]:
    """The rollout's prompt given the row's prompt and ``reset``'s return value.

    Without a row prompt the returned string becomes the user message; with one it is appended to the last user
    message. ``None`` keeps the row's prompt.
    """
    if observation is not None and not isinstance(observation, str):
        raise TypeError(
            f"environment {env_name!r}: reset() returned {type(observation).__name__}; return a str or None"
        )
    if not prompt:
        if observation is None:
            raise ValueError(
                f"environment {env_name!r}: reset() returned None and the dataset row has no 'prompt'; either return "
                "the task prompt from reset() or give the dataset a conversational 'prompt' column"
            )
        return [{"role": "user", "content": observation}]
    if observation is None:
        return prompt
    out = [dict(m) for m in prompt]
    last_user = max((i for i, m in enumerate(out) if m.get("role") == "user"), default=None)
    if last_user is None:
        return [*out, {"role": "user", "content": observation}]
    sep = "\n\n" if out[last_user].get("content") else ""
    out[last_user]["content"] = f"{out[last_user].get('content') or ''}{sep}{observation}"
    return out


class EnvironmentPool:
    """Free instances per factory name; an instance is held by at most one live rollout.

    Only the event loop's thread touches the pool (``acquire``/``release`` are not awaited across), so no lock.
    """

    def __init__(self, factories: Mapping[str, Callable[[], Any]]) -> None:
        self.factories = dict(factories)
        self._free: dict[str, list[Any]] = {name: [] for name in self.factories}
        self.created: dict[str, int] = dict.fromkeys(self.factories, 0)

    def acquire(self, name: str) -> Any:
        """A free instance of ``name`` (a new one when every existing one is held)."""
        if self._free[name]:
            return self._free[name].pop()
        env = self.factories[name]()
        if not callable(getattr(env, "reset", None)):
            raise TypeError(
                f"environment_factory{'[' + repr(name) + ']' if name else ''} returned {type(env).__name__}, which has "
                "no reset() method; environments need reset(self, **kwargs) -> str | None"
            )
        self.created[name] += 1
        return env

    def release(self, name: str, env: Any) -> None:
        """Give ``env`` back for the next rollout (it is reset before reuse)."""
        self._free[name].append(env)

    @staticmethod
    def tools_of(env: Any) -> list[Callable[..., Any]]:
        """The tools an instance exposes: its public methods except the reserved ones."""
        return environment_tools(env)

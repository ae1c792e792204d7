"""One rollout's agent context: which environment instance, its prompt and tools, and its reward (A4).

``AgentRuntime`` lives in the rollout worker next to the rollout loop. For each rollout it takes a free
environment instance for the row (routing by the ``environment`` column for a dict of factories), runs
``reset(**row)`` in the tool thread pool, builds the prompt and the tool list (the trainer's tools plus the
environment's public methods), and after the rollout calls ``get_reward()`` and gives the instance back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from asyncgrpo.rollout.agents.environments import EnvironmentPool, env_prompt, reset_kwargs, route
from asyncgrpo.rollout.agents.tools import call_maybe_async, environment_tools, tool_names

__all__ = ["AgentRuntime", "Episode"]


@dataclass
class Episode:
    """The agent context of one rollout; ``env`` is None without environments."""

    prompt: list[dict[str, Any]]
    tools: list[Callable[..., Any]]
    env: Any = None
    env_name: str = ""
    env_reward: tuple[type, float] | None = field(default=None)


class AgentRuntime:
    """Environments and tools of a run, on the worker side.

    Args:
        tools: the trainer's ``tools``.
        factories: ``environment_factory`` as a dict (``{"": factory}`` for a single one), or None.
        executor: the tool thread pool (``reset`` and ``get_reward`` run there too when sync).
        put_metric: sink for ``env/reset_s`` and ``env/reward_s``.
    """

    def __init__(
        self,
        tools: list[Callable[..., Any]],
        factories: Mapping[str, Callable[[], Any]] | None,
        executor: Executor | None,
        put_metric: Callable[[str, float], None],
    ) -> None:
        self.tools = list(tools)
        self.pool = EnvironmentPool(factories) if factories else None
        self.executor = executor
        self.put_metric = put_metric
        self._trainer_names = set(tool_names(self.tools))

    @property
    def has_tools(self) -> bool:
        """Whether the run has tools (its own or an environment's): ``tools/`` metrics are logged only then."""
        return bool(self.tools) or self.pool is not None

    async def start(self, row: Mapping[str, Any], prompt: list[dict[str, Any]] | None) -> Episode:
        """Take an environment for ``row`` (if any), reset it and return the rollout's prompt and tools."""
        if self.pool is None:
            return Episode(prompt=list(prompt or []), tools=self.tools)
        name = route(row, self.pool.factories)
        env = self.pool.acquire(name)
        try:
            t0 = time.perf_counter()
            observation = await call_maybe_async(env.reset, reset_kwargs(row), self.executor)
            self.put_metric("env/reset_s", time.perf_counter() - t0)
            env_tools = environment_tools(env)
            clash = self._trainer_names & set(tool_names(env_tools))
            if clash:
                raise ValueError(
                    f"environment {type(env).__name__} has method(s) {sorted(clash)} with the same name as tools "
                    "passed to the trainer; tools are called by name, rename one of them"
                )
            return Episode(
                env_prompt(prompt, observation, name or type(env).__name__), self.tools + env_tools, env, name
            )
        except BaseException:
            self.pool.release(name, env)
            raise

    async def finish(self, episode: Episode) -> tuple[type, float] | None:
        """Score the episode with ``get_reward()`` (when defined) and give the environment back."""
        env = episode.env
        if env is None:
            return None
        try:
            get_reward = getattr(env, "get_reward", None)
            if not callable(get_reward):
                return None
            t0 = time.perf_counter()
            value = await call_maybe_async(get_reward, {}, self.executor)
            self.put_metric("env/reward_s", time.perf_counter() - t0)
            if value is None:
                return None
            try:
                return type(env), float(value)
            except (TypeError, ValueError) as exc:
                raise TypeError(
                    f"{type(env).__name__}.get_reward() returned {value!r}; it must return a float"
                ) from exc
        finally:
            self.release(episode)

    def release(self, episode: Episode) -> None:
        """Give the episode's environment back (idempotent)."""
        if episode.env is not None and self.pool is not None:
            self.pool.release(episode.env_name, episode.env)
            episode.env = None

"""Several named held-out sets, each with its own reward functions, samples and temperature (issue 36).

    trainer = AsyncGRPOTrainer(..., eval_dataset={
        "chain_sum": EvalSet(chain_sum_ds, num_samples=4, temperature=0.7),
        "gsm": EvalSet(gsm_ds, reward_funcs=[accuracy_reward], num_samples=1),
        "calc": EvalSet(calc_ds, environment_factory=CalculatorEnv, reward_funcs=[], num_samples=4, temperature=1.0),
    })

Each set logs ``eval/<name>/reward``, ``eval/<name>/pass@k`` ... at ``eval_steps``; ``asyncgrpo eval`` reads the
same sets from the YAML's ``eval_datasets`` and prints one table per set. A plain dataset as ``eval_dataset`` stays
one set logged as ``eval/*``, as before.

A set that names an ``environment_factory`` or ``tools`` is an agent set: its episodes run through the run's own
rollout loop and tool loop, in this process (``tasks/agent_eval.py`` says why); the environment's ``get_reward``
adds to its reward functions as in training.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncgrpo.rollout.agents.environments import check_environment_factory
from asyncgrpo.rollout.agents.tools import check_tool, tool_names
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.tasks.agent_eval import evaluate_agent_set_sync
from asyncgrpo.tasks.evaluate import EvalSettings, evaluate_sync

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class EvalSet:
    """One named held-out set; None fields take the run's (its reward functions, ``eval_num_generations``,
    ``eval_temperature``, ``max_tool_calling_iterations``).

    ``environment_factory`` and ``tools`` take what the trainer takes (a class or callable, or a dict name ->
    factory routed by the rows' ``environment`` column; module-level functions): the set is then scored by
    episodes of the multi-turn tool loop. The environments are built in the evaluating process, so they need not
    pickle. ``reward_funcs=[]`` scores an agent set by its environment's ``get_reward`` alone.
    """

    dataset: Any
    reward_funcs: Sequence[Any] | None = None
    num_samples: int | None = None
    temperature: float | None = None
    environment_factory: Any = None
    tools: Sequence[Any] | None = None
    max_tool_calling_iterations: int | None = None

    @property
    def is_agent(self) -> bool:
        """Whether the set runs through the tool loop (it has an environment or tools)."""
        return self.environment_factory is not None or bool(self.tools)

    def factories(self) -> dict[str, Any] | None:
        """``environment_factory`` as the loop takes it (``{"": factory}`` for a single one), or None."""
        if self.environment_factory is None:
            return None
        return check_environment_factory(self.environment_factory, must_pickle=False)


def as_eval_sets(eval_dataset: Any) -> dict[str, EvalSet] | None:
    """``{name: EvalSet}`` for a dict of sets (a plain dataset under a name becomes a set); None for one dataset.

    Raises:
        ValueError: a name that cannot be a metric key, or a set with impossible settings.
    """
    if not isinstance(eval_dataset, Mapping):
        return None
    out = {}
    for name, value in eval_dataset.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"eval set name {name!r}: use letters, digits, '_', '-' or '.' (it becomes eval/<name>/*)")
        s = value if isinstance(value, EvalSet) else EvalSet(value)
        if s.num_samples is not None and s.num_samples < 1:
            raise ValueError(f"eval set {name}: num_samples={s.num_samples} must be >= 1")
        if s.temperature is not None and s.temperature < 0:
            raise ValueError(f"eval set {name}: temperature={s.temperature} must be >= 0 (0 is greedy)")
        _check_agent_parts(name, s)
        out[name] = s
    if not out:
        raise ValueError("eval_dataset is an empty dict: give at least one named set, or None")
    return out


def _check_agent_parts(name: str, s: EvalSet) -> None:
    """The set's environment and tools checked as the trainer checks its own, naming the set (no pickling: the
    episodes run in the evaluating process)."""
    where = f"eval set {name}"
    if s.environment_factory is not None:
        check_environment_factory(s.environment_factory, must_pickle=False, what_name=f"{where}: environment_factory")
    if s.tools is not None and not isinstance(s.tools, (list, tuple)):
        raise TypeError(f"{where}: tools must be a list of module-level functions, got {type(s.tools).__name__}")
    for t in s.tools or []:
        try:
            check_tool(t)
        except TypeError as e:
            raise TypeError(f"{where}: tool {t!r}: {e}") from e
    tool_names(list(s.tools or []))
    n = s.max_tool_calling_iterations
    if n is not None and (not s.is_agent or n < 1):
        raise ValueError(f"{where}: max_tool_calling_iterations={n} needs an environment_factory or tools and >= 1")


def set_settings(base: EvalSettings, s: EvalSet) -> EvalSettings:
    """The run's eval settings with the set's own samples and temperature."""
    changes: dict[str, Any] = {}
    if s.num_samples is not None:
        changes["num_samples"] = s.num_samples
    if s.temperature is not None:
        changes["temperature"] = s.temperature
    if s.max_tool_calling_iterations is not None:
        changes["max_tool_calling_iterations"] = s.max_tool_calling_iterations
    return dataclasses.replace(base, **changes)


def evaluate_sets(
    tokenizer: Any,
    sets: Mapping[str, EvalSet],
    reward_funcs: Sequence[Any],
    base: EvalSettings,
    prefix: str = "eval",
    progress: Callable[[str, EvalSet], Callable[[], None] | None] | None = None,
    loop_cls: type = AsyncRolloutLoop,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Every set scored in turn, its figures under ``{prefix}/{name}/``.

    Args:
        progress: ``progress(name, set)`` returns the per-prompt callback of that set (or None).
        loop_cls: the rollout loop class agent sets run through (the trainer's ``loop_cls``).
        extra: the loop's ``settings.extra`` for agent sets (an ``AsyncGRPOConfig`` subclass's fields).
    """
    out: dict[str, float] = {}
    for name, s in sets.items():
        funcs = list(s.reward_funcs) if s.reward_funcs is not None else list(reward_funcs)
        if not funcs and s.environment_factory is None:
            raise ValueError(f"eval set {name} has no reward functions: give the set reward_funcs, or the trainer some")
        tick = progress(name, s) if progress is not None else None
        settings = set_settings(base, s)
        if s.is_agent:
            out.update(evaluate_agent_set_sync(
                tokenizer, s.dataset, funcs, settings, tools=list(s.tools or []), environment_factory=s.factories(),
                loop_cls=loop_cls, prefix=f"{prefix}/{name}", progress=tick, extra=extra,
            ))  # fmt: skip
        else:
            out.update(evaluate_sync(tokenizer, s.dataset, funcs, settings, f"{prefix}/{name}", tick))
    return out


def evaluate_held_out(
    tokenizer: Any,
    held_out: Any,
    reward_funcs: Sequence[Any],
    base: EvalSettings,
    prefix: str = "eval",
    *,
    loop_cls: type = AsyncRolloutLoop,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """The trainer's evaluation: named sets (a dict) under ``{prefix}/{name}/``, one plain dataset under ``{prefix}/``."""
    sets = as_eval_sets(held_out)
    if sets is not None:
        return evaluate_sets(tokenizer, sets, reward_funcs, base, prefix, loop_cls=loop_cls, extra=extra)
    return evaluate_sync(tokenizer, held_out, list(reward_funcs), base, prefix)

"""Several named held-out sets, each with its own reward functions, samples and temperature (issue 36).

    trainer = AsyncGRPOTrainer(..., eval_dataset={
        "chain_sum": EvalSet(chain_sum_ds, num_samples=4, temperature=0.7),
        "gsm": EvalSet(gsm_ds, reward_funcs=[accuracy_reward], num_samples=1),
    })

Each set logs ``eval/<name>/reward``, ``eval/<name>/pass@k`` ... at ``eval_steps``; ``asyncgrpo eval`` reads the
same sets from the YAML's ``eval_datasets`` and prints one table per set. A plain dataset as ``eval_dataset`` stays
one set logged as ``eval/*``, as before.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from asyncgrpo.tasks.evaluate import EvalSettings, evaluate_sync

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class EvalSet:
    """One named held-out set; None fields take the run's (its reward functions, ``eval_num_generations``,
    ``eval_temperature``)."""

    dataset: Any
    reward_funcs: Sequence[Any] | None = None
    num_samples: int | None = None
    temperature: float | None = None


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
        out[name] = s
    if not out:
        raise ValueError("eval_dataset is an empty dict: give at least one named set, or None")
    return out


def set_settings(base: EvalSettings, s: EvalSet) -> EvalSettings:
    """The run's eval settings with the set's own samples and temperature."""
    changes: dict[str, Any] = {}
    if s.num_samples is not None:
        changes["num_samples"] = s.num_samples
    if s.temperature is not None:
        changes["temperature"] = s.temperature
    return dataclasses.replace(base, **changes)


def evaluate_sets(
    tokenizer: Any,
    sets: Mapping[str, EvalSet],
    reward_funcs: Sequence[Any],
    base: EvalSettings,
    prefix: str = "eval",
    progress: Callable[[str, EvalSet], Callable[[], None] | None] | None = None,
) -> dict[str, float]:
    """Every set scored in turn, its figures under ``{prefix}/{name}/``.

    Args:
        progress: ``progress(name, set)`` returns the per-prompt callback of that set (or None).
    """
    out: dict[str, float] = {}
    for name, s in sets.items():
        funcs = list(s.reward_funcs) if s.reward_funcs is not None else list(reward_funcs)
        if not funcs:
            raise ValueError(f"eval set {name} has no reward functions: give the set reward_funcs, or the trainer some")
        tick = progress(name, s) if progress is not None else None
        out.update(evaluate_sync(tokenizer, s.dataset, funcs, set_settings(base, s), f"{prefix}/{name}", tick))
    return out

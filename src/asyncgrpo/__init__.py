"""asyncgrpo: asynchronous GRPO — a generation server streams rollouts while the trainer learns from them.

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.tasks import accuracy_reward

Heavy modules (torch, transformers) load on first use of a name, so the
command-line tool and the rollout worker start quickly. ``__all__`` is the
top-level API; the public modules are listed in ``asyncgrpo.import_paths.PUBLIC_MODULES``
(and docs/usage.md), and paths that earlier docs showed keep working with a warning.
"""

from __future__ import annotations

import importlib
from typing import Any

from asyncgrpo import import_paths

__version__ = "0.1.0"  # the one place: pyproject.toml reads it (tool.setuptools.dynamic)

import_paths.install()

_EXPORTS = {
    "AsyncGRPOConfig": "asyncgrpo.config",
    "AsyncGRPOTrainer": "asyncgrpo.trainer.trainer",
    "AsyncRolloutLoop": "asyncgrpo.rollout.loop",
    "Rollout": "asyncgrpo.types",
    "RolloutGroup": "asyncgrpo.types",
    "TrainingSequence": "asyncgrpo.types",
    "TurnRecord": "asyncgrpo.types",
}

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "AsyncRolloutLoop",
    "Rollout",
    "RolloutGroup",
    "TrainingSequence",
    "TurnRecord",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'asyncgrpo' has no attribute {name!r}")

"""The import paths users write: the public modules (docs/usage.md lists them), and old paths that keep working.

A run's YAML names its rewards by path (``asyncgrpo.tasks.reasoning:numeric_answer_reward``) and scripts import
from the documented modules, so a path that a release's docs showed is part of the API. When a module moves, its
old path stays in :data:`MOVED`: importing it gives a thin alias of the new module, and the first name taken
from it gives one ``DeprecationWarning`` and one log line naming the new path (``import old.package.module``
warns for the module alone). ``asyncgrpo/__init__.py`` installs the finder.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import types
import warnings
from typing import Any

logger = logging.getLogger(__name__)

# module -> what users take from it (docs/usage.md, "Public API", lists the same; a test compares them)
PUBLIC_MODULES = {
    "asyncgrpo": "AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop and the records that cross processes",
    "asyncgrpo.tasks": "rewards and datasets: accuracy_reward, numeric_answer_reward, format_reward, "
    "reasoning_gym_reward, reasoning_gym_dataset",
    "asyncgrpo.tasks.reasoning": "the reasoning-gym datasets and their rewards, by module",
    "asyncgrpo.tasks.accuracy": "accuracy_reward (math answers checked with math-verify)",
    "asyncgrpo.assets": "offline models: demo_model_dir, tiny_model_dir",
    "asyncgrpo.assets.tool_warmup": "the supervised tool warm-up: Transcript, warm_up_tool_calls",
    "asyncgrpo.server.launcher": "launch_server: start `asyncgrpo serve` from Python and wait for /health",
    "asyncgrpo.rollout.agents": "tools and environments for multi-turn rollouts (docs/agents.md)",
    "asyncgrpo.types": "Rollout, RolloutGroup, TrainingSequence, TurnRecord",
}

# old path -> new path: every module path that a release's README or docs showed, and the rest of those old
# packages (0.1.0's re-layout: recipes/ became assets/ and tasks/, rewards/ went into tasks/)
MOVED = {
    "asyncgrpo.recipes": "asyncgrpo.assets",
    "asyncgrpo.recipes.tasks": "asyncgrpo.tasks.reasoning",
    "asyncgrpo.recipes.tool_warmup": "asyncgrpo.assets.tool_warmup",
    "asyncgrpo.recipes.tiny": "asyncgrpo.assets.tiny",
    "asyncgrpo.recipes.assets": "asyncgrpo.assets.demo_model",
    "asyncgrpo.rewards": "asyncgrpo.tasks",
    "asyncgrpo.rewards.accuracy": "asyncgrpo.tasks.accuracy",
    "asyncgrpo.docs": "asyncgrpo.cli.docs",
}


@functools.cache
def warn_moved(old: str, new: str) -> None:
    """Once per old path and process: a DeprecationWarning (for ``-W error`` and test runs) and one log line."""
    message = f"{old} moved to {new}; the old path still works but will be removed: import {new} instead"
    warnings.warn(message, DeprecationWarning, stacklevel=3)  # the frame that took the name (import frames skipped)
    logger.warning(message)


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as a module that forwards every attribute to its new module."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        old, target = module.__name__, importlib.import_module(self.new)

        def forward(name: str) -> Any:
            if name.startswith("__"):  # tools probing __file__ and the like: not a use of the old path
                raise AttributeError(name)
            warn_moved(old, self.new)
            return getattr(target, name)

        module.__getattr__ = forward  # PEP 562: names not set here come from the new module
        module.__dir__ = lambda: dir(target)
        module.__doc__ = f"Moved to {self.new} (this alias warns once)."
        if hasattr(target, "__all__"):
            module.__all__ = list(target.__all__)

    def get_code(self, fullname: str) -> types.CodeType | None:
        """``python -m OLD`` runs the new module's code (runpy asks the loader for it)."""
        warn_moved(fullname, self.new)
        spec = importlib.util.find_spec(self.new)
        assert spec is not None and spec.loader is not None, self.new
        return spec.loader.get_code(self.new)  # type: ignore[attr-defined]


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old paths of :data:`MOVED` (before the path finder, which would find nothing there)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        is_package = any(old.startswith(fullname + ".") for old in MOVED)  # its moved submodules import through it
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new), is_package=is_package)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (importing ``asyncgrpo`` does this)."""
    import sys

    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())

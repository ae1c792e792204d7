"""Makes ``triton`` look uninstalled in every Python process that has this folder first on ``PYTHONPATH``.

Python imports ``sitecustomize`` at start-up, so spawned children (the engine process, the rollout worker) get it
too. The path finder is wrapped so that it does not see ``triton``: ``importlib.util.find_spec("triton")`` is
None and ``import triton`` raises ``ModuleNotFoundError``, as on a CPU-only install. Each lookup that an
``asyncgrpo`` file makes is appended to the file named by ``HIDE_TRITON_LOG`` ("module lookup from file:line"),
so a test can also tell that nothing even tried.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import PathFinder

_IMPORT_FILES = ("<frozen importlib", os.sep + os.path.join("importlib", ""))


def _hidden(name: str) -> bool:
    return name == "triton" or name.startswith("triton.")


def _record(name: str) -> None:
    log = os.environ.get("HIDE_TRITON_LOG")
    frame = sys._getframe(2)
    while frame is not None and any(part in frame.f_code.co_filename for part in _IMPORT_FILES):
        frame = frame.f_back  # skip the import system's own frames: the caller is the file that asked
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "?"
    if log and os.sep + "asyncgrpo" + os.sep in where:
        with open(log, "a") as fh:
            fh.write(f"{name} lookup from {where}\n")


class _PathFinderWithoutTriton:
    """``PathFinder`` for every module but ``triton`` and its submodules."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if _hidden(name):
            _record(name)
            return None
        return PathFinder.find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        """importlib.metadata asks the meta path too: no ``triton`` distribution either."""
        context = args[0] if args else kwargs.get("context")
        if _hidden((getattr(context, "name", None) or "").lower()):
            return iter(())
        return PathFinder.find_distributions(*args, **kwargs)

    @classmethod
    def invalidate_caches(cls) -> None:
        PathFinder.invalidate_caches()


sys.meta_path[:] = [_PathFinderWithoutTriton if f is PathFinder else f for f in sys.meta_path]
for _name in [n for n in sys.modules if _hidden(n)]:
    del sys.modules[_name]

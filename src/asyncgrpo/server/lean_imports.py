"""transformers imported in asyncgrpo's own processes without the packages they never call.

Why: transformers up to 5.17 imports scikit-learn at import time wherever it is installed (its assisted-generation
code takes ``roc_curve`` from it; later releases import it on first use), and scikit-learn pulls in SciPy. On an
H200 machine that was about 2 s of each server process's start (profiled: ``bench/results/engine_start_h200.json``),
for a function the server never calls. While :func:`without_unused_packages` is entered, Python's import system
reports those packages as absent (``sys.modules[name] = None``: ``importlib.util.find_spec`` answers None, so
transformers' availability check says no and skips the import); on leaving, the packages are importable again.

Only the processes of asyncgrpo's own commands hide anything: the server's entry points and the ``asyncgrpo``
command call :func:`enable`. The server runs no user code; the command's trainer process enters the block only
to import the config (``cli.launch.import_config``), after the YAML's reward modules and before any thread starts.
Elsewhere (an engine or trainer built inside a user's process, the tests) the block changes nothing, so a user's
``import sklearn`` can never fail because of it. ``ASYNCGRPO_LEAN_IMPORTS=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

UNUSED_BY_SERVER = ("sklearn",)
ENV = "ASYNCGRPO_LEAN_IMPORTS"
_enabled = False


def enable() -> None:
    """Mark this process as one of asyncgrpo's commands (the entry points call this before importing transformers)."""
    global _enabled
    _enabled = os.environ.get(ENV) != "0"


@contextlib.contextmanager
def without_unused_packages(names: tuple[str, ...] = UNUSED_BY_SERVER) -> Iterator[list[str]]:
    """Hide ``names`` from imports inside the block; yields those hidden (one imported already stays as it is)."""
    hidden = [n for n in names if n not in sys.modules] if _enabled else []
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # the import system's own "known absent" mark
    try:
        yield hidden
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]

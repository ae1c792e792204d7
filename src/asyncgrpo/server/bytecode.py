"""Compiled bytecode for the server's imports where the environment turns writing it off.

Why: each of the server's two processes imports torch and transformers, thousands of modules. Where
``PYTHONDONTWRITEBYTECODE`` is set (many container images set it) and site-packages hold no ``.pyc`` files (uv, for
one, installs without them), every start compiles all of them from source again: on an H200 machine that made the
engine's start 14.7 s instead of 7.5 s and the HTTP process's tokenizer phase 11.6 s instead of 5.8 s, on every
start, not only the first. Where torch has its bytecode beside its sources, nothing changes (a folder of our own
would only make Python compile everything once more).

Then the server keeps the bytecode in a folder of its own (Python's ``PYTHONPYCACHEPREFIX`` mechanism: a tree
mirroring the sources, each ``.pyc`` checked against its source's mtime and size as always), so the sources'
folders stay as they are and every start after the first reads compiled modules. The engine process and the answer
workers find the folder through the environment from their first import.

``ASYNCGRPO_PYCACHE=0`` leaves the environment's choice alone; ``ASYNCGRPO_PYCACHE=DIR`` picks the folder (default
``$ASYNCGRPO_CACHE/pycache``, else ``~/.cache/asyncgrpo/pycache``). A ``PYTHONPYCACHEPREFIX`` already set is used.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

ENV = "ASYNCGRPO_PYCACHE"


def default_folder() -> str:
    """``$ASYNCGRPO_CACHE/pycache`` or ``~/.cache/asyncgrpo/pycache`` (the asset cache's folder, assets/demo_model.py)."""
    root = os.environ.get("ASYNCGRPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "asyncgrpo")
    return os.path.join(root, "pycache")


def has_bytecode(module: str) -> bool:
    """Whether ``module`` (found, not imported) has a ``.pyc`` where Python looks for it now."""
    try:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        return bool(origin and origin.endswith(".py") and os.path.exists(importlib.util.cache_from_source(origin)))
    except (ImportError, ValueError, NotImplementedError):
        return False


def keep_bytecode(probe: str = "torch") -> str | None:
    """Where this process may not write bytecode and ``probe`` (the largest import) has none, write it to the
    server's own folder from now on; returns the folder, or None where nothing changed (bytecode is written already
    or there, ``ASYNCGRPO_PYCACHE=0``, no writable folder). Where a prefix folder is set already (the engine process
    gets the API process's), bytecode is written there: its own modules (the model's, Triton) too."""
    choice = os.environ.get(ENV, "")
    if choice == "0" or not sys.dont_write_bytecode:
        return None
    if sys.pycache_prefix is None and has_bytecode(probe):
        return None
    chosen_here = sys.pycache_prefix is None  # not inherited from the process that started this one
    folder = sys.pycache_prefix or choice or default_folder()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK | os.X_OK):
        return None
    sys.pycache_prefix = folder
    sys.dont_write_bytecode = False
    os.environ["PYTHONPYCACHEPREFIX"] = folder  # child processes read it from their start
    if chosen_here:
        logger.info("PYTHONDONTWRITEBYTECODE is set: bytecode is kept in %s (%s=0: off)", folder, ENV)
    return folder

"""Compiled bytecode for the server's imports where the environment turns writing it off.

Why: each of the server's two processes imports torch and transformers, thousands of modules. Where
``PYTHONDONTWRITEBYTECODE`` is set (many container images set it) and site-packages hold no ``.pyc`` files, every
start compiles all of them from source again: on an H200 machine that made the engine's start 14.7 s instead of
7.5 s and the HTTP process's tokenizer phase 11.6 s instead of 5.8 s, on every start, not only the first.

Then the server keeps the bytecode in a folder of its own (Python's ``PYTHONPYCACHEPREFIX`` mechanism: a tree
mirroring the sources, each ``.pyc`` checked against its source's mtime and size as always), so the sources'
folders stay as they are and every start after the first reads compiled modules. The engine process and the answer
workers find the folder through the environment from their first import.

``ASYNCGRPO_PYCACHE=0`` leaves the environment's choice alone; ``ASYNCGRPO_PYCACHE=DIR`` picks the folder (default
``$ASYNCGRPO_CACHE/pycache``, else ``~/.cache/asyncgrpo/pycache``). A ``PYTHONPYCACHEPREFIX`` already set is used.
"""

from __future__ import annotations

import os
import sys

ENV = "ASYNCGRPO_PYCACHE"


def default_folder() -> str:
    """``$ASYNCGRPO_CACHE/pycache`` or ``~/.cache/asyncgrpo/pycache`` (the asset cache's folder, assets/demo_model.py)."""
    root = os.environ.get("ASYNCGRPO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "asyncgrpo")
    return os.path.join(root, "pycache")


def keep_bytecode() -> str | None:
    """Where this process may not write bytecode, write it to the server's own folder from now on; returns the
    folder, or None where nothing changed (bytecode is written already, ``ASYNCGRPO_PYCACHE=0``, no writable folder).
    """
    choice = os.environ.get(ENV, "")
    if choice == "0" or not sys.dont_write_bytecode:
        return None
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
    return folder

"""Triton is needed on CUDA only, so it is imported on the first CUDA use, never when a module loads.

PyPI's CUDA builds of torch for Linux require Triton; the CPU builds do not have it. A CPU install therefore
never imports it (``asyncgrpo serve --device cpu`` and ``asyncgrpo train`` on CPU run torch's own ops), and a
CUDA install without it runs the same torch paths after one warning that names the package to install
(docs/design.md, "Imports follow the hardware").
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
from types import ModuleType

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install triton (PyPI's CUDA builds of torch for Linux bring it; the CPU builds do not)"


@functools.cache
def have_triton() -> bool:
    """Whether ``import triton`` can work, found without importing it (a CPU install pays nothing)."""
    return importlib.util.find_spec("triton") is not None


_warned: list[str] = []  # the first fast path found without Triton in this process


def warn_missing(what: str) -> None:
    """One line per process, naming the first fast path that is off and the package that turns them all on."""
    if _warned:
        return
    _warned.append(what)
    logger.warning(
        "%s (and the other CUDA kernels) need Triton, which is not installed: running torch's ops instead; %s",
        what, INSTALL_HINT,
    )  # fmt: skip


@functools.cache
def load_kernels(module: str, what: str) -> ModuleType | None:
    """Import the Triton kernel module ``module`` on first use; None (after :func:`warn_missing`) without Triton.

    Only a missing ``triton`` turns into None: any other import error of the module is a bug and propagates.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is None or e.name.split(".")[0] != "triton":
            raise
        warn_missing(what)
        return None

"""The integration tests' default server; ``serve`` and ``tiny_llama_dir`` come from ``tests/conftest.py``.

``serve(model_dir, *flags)`` starts a real ``asyncgrpo serve`` on a free port, waits for ``/health``
(with a timeout; the server log tail is in the error) and stops it when the test module ends.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from asyncgrpo.server.launcher import ServerProcess


@pytest.fixture(scope="module")
def tiny_server(serve: Callable[..., ServerProcess], tiny_llama_dir: Path) -> ServerProcess:
    """A server on the tiny Llama (fp32, CPU) with default flags and max_model_len 128."""
    return serve(tiny_llama_dir, "--max-model-len", "128")

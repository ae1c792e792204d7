"""The real-vLLM lane as a pytest plugin: ``pytest -p tests.vllm_lane.plugin tests/conformance tests/vllm_lane``.

At start it builds the lane's model, starts one vLLM server from the lane's venv (``ASYNCGRPO_VLLM_PYTHON``, made
by ``tests/vllm_lane/install.sh``) and points the conformance suite at it (``ASYNCGRPO_VLLM_URL``); the
end-to-end tests get the same server through the ``real_vllm`` fixture (the restart test restarts it). The
server stops when the session ends.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tests.conformance.conftest import VLLM_URL_ENV
from tests.vllm_lane.real_vllm import RealVllm

PYTHON_ENV = "ASYNCGRPO_VLLM_PYTHON"
LANE_ENV = "ASYNCGRPO_VLLM_LANE"  # set while the lane runs: tests/vllm_lane is collected only then
_SERVER: RealVllm | None = None
# Set on import (``-p`` loads this module before the first conftest files, whose collect_ignore reads it).
os.environ[LANE_ENV] = "1"


def pytest_configure(config: pytest.Config) -> None:
    global _SERVER
    python = os.environ.get(PYTHON_ENV)
    if not python or not Path(python).is_file():
        raise pytest.UsageError(f"{PYTHON_ENV} must name the python of the vLLM lane's venv (run "
                                "tests/vllm_lane/install.sh, or `make test-vllm`)")  # fmt: skip
    from tests.vllm_lane.lane_model import lane_model_dir

    logs = Path(os.environ.get("ASYNCGRPO_VLLM_LOG_DIR") or tempfile.mkdtemp(prefix="asyncgrpo-vllm-lane-"))
    _SERVER = RealVllm(python, lane_model_dir(), logs)
    _SERVER.start()
    os.environ[VLLM_URL_ENV] = _SERVER.base_url


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SERVER is not None:
        _SERVER.stop()
        print(f"[vllm lane] vLLM start-up times: {', '.join(f'{s:.0f}s' for s in _SERVER.starts)}; logs in "
              f"{_SERVER.log_dir}", flush=True)  # fmt: skip


@pytest.fixture(scope="session")
def real_vllm() -> RealVllm:
    """The lane's vLLM server (started by the plugin)."""
    assert _SERVER is not None, "the real-vLLM lane plugin did not start a server"
    return _SERVER

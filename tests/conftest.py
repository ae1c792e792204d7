"""Shared test setup: skip `gpu` tests without CUDA; the tiny model and real server processes every suite uses.

The suite runs on ``-n auto --dist loadfile`` (pyproject's addopts, pytest-xdist): one process per core, at most
four, each running whole test files, so a file's module-scoped servers start once. A sequential test process keeps
about one of CI's two cores busy (tests wait on servers, workers and subprocesses), hence the second process. With
CUDA present it runs in one process: GPU tests share the devices.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asyncgrpo.server.launcher import ServerProcess
from tests.helpers.servers import start_cpu_server

MAX_TEST_PROCESSES = 4  # each one starts its own servers (about 1 GiB each)

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One compute thread per process (inherited by the servers, workers and scripts a test starts): the test processes
    # already use every core, and OpenMP threads of oversubscribed processes spin while waiting for each other.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@functools.cache
def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return False


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one test process per core (at most four); none besides this one with CUDA or a single core."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    if _has_cuda():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cores, MAX_TEST_PROCESSES) if cores > 1 else 0


def _slow_files_first(items: list[pytest.Item]) -> None:
    """Files with a ``slow`` test go first (each stays in one piece): the test processes share out the long files
    early and the many short ones fill the end, instead of one process running a long file alone at the end."""
    slow = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow)


def _lanes(items: list[pytest.Item], long_lane: bool, readme_lane: bool) -> None:
    """``make test`` (10 minutes on 2 cores) leaves out the lanes' tests; each lane runs only its own. CI runs
    ``make test``, then ``make test-long``, ``make test-readme`` and ``make test-vllm``."""
    for item in items:
        if "readme" in item.keywords and not readme_lane:
            item.add_marker(pytest.mark.skip(reason="a README snippet on the demo model: runs in `make test-readme`"))
        elif "long" in item.keywords and not long_lane:
            item.add_marker(pytest.mark.skip(reason="an end-to-end scenario of minutes: runs in `make test-long`"))
        elif long_lane and "long" not in item.keywords:
            item.add_marker(pytest.mark.skip(reason="not a long-lane test: runs in `make test`"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _slow_files_first(items)
    _lanes(items, long_lane=bool(os.environ.get("ASYNCGRPO_LONG_LANE")),
           readme_lane=bool(os.environ.get("ASYNCGRPO_README_LANE")))  # fmt: skip
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """The cached tiny random-init Llama with the real SmolLM2 tokenizer."""
    from asyncgrpo.assets import tiny_model_dir

    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def serve() -> Iterator[Callable[..., ServerProcess]]:
    """Factory: ``serve(model_dir, "--flag", ...)`` -> a running server, stopped at module teardown."""
    started: list[ServerProcess] = []

    def start(model_dir: Path | str, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
        started.append(start_cpu_server(model_dir, *flags, env=env))
        return started[-1]

    yield start
    for server in started:
        server.stop()

"""Shared test setup: skip `gpu` tests without CUDA; the tiny model and real server processes every suite uses."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asyncgrpo.server.launcher import ServerProcess
from tests.helpers.servers import start_cpu_server


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_llama_dir() -> Path:
    """The cached tiny random-init Llama with the real SmolLM2 tokenizer."""
    from asyncgrpo.recipes import tiny_model_dir

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

"""Real ``asyncgrpo serve`` subprocesses for the integration tests.

``serve(model_dir, *flags)`` starts one on a free port, waits for ``/health``
(with a timeout; the server log tail is in the error) and stops it when the test
module ends, so a module shares one server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asyncgrpo.server.launcher import ServerProcess, launch_server

SERVER_START_TIMEOUT_S = 240.0  # 2 shared CPU cores: imports + model load can be slow under load


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
        server = launch_server(
            model_dir, extra_args=["--device", "cpu", *flags] if "--device" not in flags else list(flags),
            env={"CUDA_VISIBLE_DEVICES": "", **(env or {})}, timeout=SERVER_START_TIMEOUT_S,
        )  # fmt: skip
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def tiny_server(serve: Callable[..., ServerProcess], tiny_llama_dir: Path) -> ServerProcess:
    """A server on the tiny Llama (fp32, CPU) with default flags and max_model_len 128."""
    return serve(tiny_llama_dir, "--max-model-len", "128")

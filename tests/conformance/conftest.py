"""The server the conformance suite talks to: the embedded server, or a real vLLM named by ``ASYNCGRPO_VLLM_URL``.

Against a real vLLM (started as docs/protocol.md documents, with
``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config '{"backend": "nccl"}'``,
``--logprobs-mode processed_logprobs`` and without ``--return-sampling-mask``)
the same tests run unchanged; the ones that need to restart the server with
special flags (``embedded(...)``) or need our tiny model's weights skip.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncgrpo.server.launcher import ServerProcess
from tests.helpers.servers import start_cpu_server

VLLM_URL_ENV = "ASYNCGRPO_VLLM_URL"


@dataclass
class Target:
    """A server under test: ``embedded`` is False for a real vLLM (whose model we do not know)."""

    base_url: str
    embedded: bool


def real_vllm_url() -> str | None:
    return os.environ.get(VLLM_URL_ENV) or None


def needs_embedded(reason: str) -> None:
    if real_vllm_url():
        pytest.skip(f"embedded server only: {reason} ({VLLM_URL_ENV} is set)")


@pytest.fixture(scope="module")
def embedded(serve: Callable[..., ServerProcess]) -> Callable[..., ServerProcess]:
    """Factory: ``embedded(model_dir, *flags, env=...)`` -> a running embedded server (skips against a real vLLM)."""

    def start(model_dir: Path | str, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
        needs_embedded("starts servers of its own with other flags")
        return serve(model_dir, *flags, env=env)

    return start


@pytest.fixture(scope="session")
def target(tiny_llama_dir: Path) -> Iterator[Target]:
    """The server every module shares: a real vLLM when ``ASYNCGRPO_VLLM_URL`` is set, else an embedded one."""
    url = real_vllm_url()
    if url:
        yield Target(url.rstrip("/"), embedded=False)
        return
    server = start_cpu_server(tiny_llama_dir, "--max-model-len", "256")
    try:
        yield Target(server.base_url, embedded=True)
    finally:
        server.stop()

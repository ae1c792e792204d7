"""Start an embedded server as a child process and wait until it answers.

Used by the demo, the trainer ("start the server for me") and the tests, so the
server always runs in its own process exactly as a user would start it.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Self

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running ``asyncgrpo serve`` child; use as a context manager to stop it on exit."""

    def __init__(self, proc: subprocess.Popen, base_url: str, log_path: Path) -> None:
        self.proc = proc
        self.base_url = base_url
        self.log_path = log_path

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch_server(
    model: str | os.PathLike,
    *,
    port: int | None = None,
    host: str = "127.0.0.1",
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_path: str | os.PathLike | None = None,
    timeout: float = 300.0,
) -> ServerProcess:
    """Start ``python -m asyncgrpo serve MODEL`` and wait for ``/health`` to answer 200.

    Raises:
        TimeoutError: the server did not become healthy within ``timeout`` seconds (the message
            carries the tail of its log).
        RuntimeError: the server process exited during start-up (with its log tail).
    """
    port = port or free_port()
    log = Path(log_path) if log_path else Path(os.environ.get("TMPDIR", "/tmp")) / f"asyncgrpo-serve-{port}.log"
    cmd = [sys.executable, "-m", "asyncgrpo", "serve", str(model), "--host", host, "--port", str(port), *extra_args]
    logger.info("starting the generation server: %s (log: %s)", " ".join(cmd), log)
    with open(log, "w") as fh:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(proc, f"http://{host}:{port}", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the generation server exited with code {proc.returncode} during start-up:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.25)
    server.stop()
    raise TimeoutError(
        f"waited {timeout:.0f}s for the generation server at {server.base_url}/health; log tail:\n{server.log_tail()}"
    )

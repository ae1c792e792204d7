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
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Self

logger = logging.getLogger(__name__)

SERVER_PID_HEADER = "X-Asyncgrpo-Server-Pid"  # the server's /health names its process (server/http/app.py)


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


LOG_EVERY_S = 30.0  # a start that takes longer prints a line this often
START_ATTEMPTS = 3  # ports tried when the caller left the port to us and another process took the one we chose


class PortTaken(RuntimeError):
    """Another process answers on the port this server was started on (it cannot bind it)."""


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
    """Start ``python -m asyncgrpo serve MODEL`` and wait until it answers ``/health`` with 200 as itself.

    A free port is only free until someone binds it: when another process answers on the port (``/health`` names
    another pid in its ``X-Asyncgrpo-Server-Pid`` header, or none), the start fails at once instead of handing back that other server. With
    ``port=None`` another free port is tried, up to ``START_ATTEMPTS`` in all.

    Raises:
        TimeoutError: the server did not become healthy within ``timeout`` seconds (the message
            carries the tail of its log).
        RuntimeError: the server process exited during start-up (with its log tail).
        PortTaken: another process answers on ``port`` (a ``RuntimeError``; the message names the fix).
    """
    deadline = time.monotonic() + timeout
    attempts = START_ATTEMPTS if port is None else 1
    for attempt in range(1, attempts + 1):
        chosen = port or free_port()
        log = Path(log_path) if log_path else _log_file(chosen)
        cmd = [sys.executable, "-m", "asyncgrpo", "serve", str(model), "--host", host, "--port", str(chosen),
               *extra_args]  # fmt: skip
        logger.info("starting the generation server: %s (log: %s)", " ".join(cmd), log)
        with open(log, "w") as fh:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        server = ServerProcess(proc, f"http://{host}:{chosen}", log)
        try:
            return _await_ready(server, deadline, timeout)
        except PortTaken as exc:
            server.stop()
            if attempt == attempts:
                raise
            logger.warning("%s; trying another port", exc)
    raise AssertionError("unreachable")  # pragma: no cover


def _log_file(port: int) -> Path:
    """A log file of this start alone (two launchers that chose one port must not write one file)."""
    fd, name = tempfile.mkstemp(prefix=f"asyncgrpo-serve-{port}-", suffix=".log")
    os.close(fd)
    return Path(name)


def _await_ready(server: ServerProcess, deadline: float, timeout: float) -> ServerProcess:
    proc = server.proc
    t0 = last_line = time.monotonic()
    while time.monotonic() < deadline:
        if time.monotonic() >= last_line + LOG_EVERY_S:  # loading a large model takes minutes: say what we wait for
            last_line = time.monotonic()
            logger.info("waiting for the generation server at %s to answer /health (%.0f s so far; log: %s)",
                        server.base_url, last_line - t0, server.log_path)  # fmt: skip
        if proc.poll() is not None:
            raise RuntimeError(
                f"the generation server exited with code {proc.returncode} during start-up:\n{server.log_tail()}"
            )
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=2) as r:
                healthy, answering = r.status == 200, r.headers.get(SERVER_PID_HEADER)
            if healthy:
                if answering == str(proc.pid):
                    return server
                who = f"pid {answering}" if answering else "a process that is not an asyncgrpo server"
                raise PortTaken(
                    f"{server.base_url} is answered by {who}, not by the server just started (pid {proc.pid}); "
                    "give it a free --port"
                )
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            pass
        time.sleep(0.25)
    server.stop()
    raise TimeoutError(
        f"waited {timeout:.0f}s for the generation server at {server.base_url}/health; log tail:\n{server.log_tail()}"
    )

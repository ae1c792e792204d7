"""Start an embedded server as a child process and wait until it answers (now, or later: ``wait=False``).

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
    """A running ``asyncgrpo serve`` child; use as a context manager to stop it on exit.

    From ``launch_server(..., wait=False)`` it may still be starting: :meth:`wait_ready` waits for it.
    """

    def __init__(self, proc: subprocess.Popen, base_url: str, log_path: Path, timeout: float = 300.0,
                 launched: float | None = None) -> None:  # fmt: skip
        self.proc = proc
        self.base_url = base_url
        self.log_path = log_path
        self.timeout = timeout  # the start's bound, counted from the launch (``launched``, monotonic; default now)
        self._launched = time.monotonic() if launched is None else launched
        self._ready = False

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout: float | None = None) -> Self:
        """Wait until the server answers ``/health`` with 200 as itself; returns it. Idempotent.

        ``timeout``: seconds from now; None: what is left of the launch's ``timeout``. Raises as
        :func:`launch_server` does (``TimeoutError``, ``RuntimeError``, ``PortTaken``), and stops the process first.
        """
        if self._ready:
            return self
        bound = self.timeout if timeout is None else timeout
        deadline = self._launched + self.timeout if timeout is None else time.monotonic() + timeout
        try:
            _await_ready(self, deadline, bound)
        except PortTaken:
            self.stop()
            raise
        self._ready = True
        return self

    def answers(self, timeout: float = 0.5) -> bool:
        """Whether the server serves now, from one ``/health`` probe: never waits longer than ``timeout`` and never
        raises (a start that failed is reported by :meth:`wait_ready`). For work that can stop at the first safe
        point once the server is up (the trainer's compile warm-up)."""
        if self._ready:
            return self.alive()
        health = _health(self.base_url, timeout) if self.alive() else None
        return health is not None and health[0] and health[1] == str(self.proc.pid)

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
    wait: bool = True,
) -> ServerProcess:
    """Start ``python -m asyncgrpo serve MODEL`` and wait until it answers ``/health`` with 200 as itself.

    A free port is only free until someone binds it: when another process answers on the port (``/health`` names
    another pid in its ``X-Asyncgrpo-Server-Pid`` header, or none), the start fails at once instead of handing back
    that other server. With ``port=None`` another free port is tried, up to ``START_ATTEMPTS`` in all.

    ``wait=False`` returns the process at once, so the caller builds its own side (a trainer loads its model) while
    the server starts; :meth:`ServerProcess.wait_ready` then waits (within ``timeout`` of the launch). Its
    ``base_url`` is final: a taken port raises ``PortTaken`` from ``wait_ready``, never moves to another one.

    Raises:
        TimeoutError: the server did not become healthy within ``timeout`` seconds (the message
            carries the tail of its log).
        RuntimeError: the server process exited during start-up (with its log tail).
        PortTaken: another process answers on ``port`` (a ``RuntimeError``; the message names the fix).
    """
    attempts = START_ATTEMPTS if port is None and wait else 1
    t0 = time.monotonic()
    for attempt in range(1, attempts + 1):
        chosen = port or free_port()
        log = Path(log_path) if log_path else _log_file(chosen)
        cmd = [sys.executable, "-m", "asyncgrpo", "serve", str(model), "--host", host, "--port", str(chosen),
               *extra_args]  # fmt: skip
        logger.info("starting the generation server: %s (log: %s)", " ".join(cmd), log)
        with open(log, "w") as fh:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        server = ServerProcess(proc, f"http://{host}:{chosen}", log, timeout, launched=t0)  # retries share t0's bound
        if not wait:
            return server
        try:
            return server.wait_ready()
        except PortTaken as exc:
            if attempt == attempts:
                raise
            logger.warning("%s; trying another port", exc)
    raise AssertionError("unreachable")  # pragma: no cover


def _log_file(port: int) -> Path:
    """A log file of this start alone (two launchers that chose one port must not write one file)."""
    fd, name = tempfile.mkstemp(prefix=f"asyncgrpo-serve-{port}-", suffix=".log")
    os.close(fd)
    return Path(name)


def _health(base_url: str, timeout: float) -> tuple[bool, str | None] | None:
    """One ``/health`` probe: (answered 200, the answering server's pid header), or None when nothing answered."""
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=timeout) as r:
            return r.status == 200, r.headers.get(SERVER_PID_HEADER)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return None


def _await_ready(server: ServerProcess, deadline: float, timeout: float) -> ServerProcess:
    """Poll ``/health`` until the server answers as itself (see :meth:`ServerProcess.wait_ready`)."""
    proc = server.proc
    t0 = last_line = time.monotonic()
    while time.monotonic() < deadline:
        if time.monotonic() >= last_line + LOG_EVERY_S:  # loading a large model takes minutes: say what we wait for
            last_line = time.monotonic()
            logger.info("waiting for the generation server at %s to answer /health (%.0f s so far; log: %s)",
                        server.base_url, last_line - t0, server.log_path)  # fmt: skip
        exited = proc.poll() is not None
        # probed after an exit too: one that exited because another process holds its port is PortTaken
        health = _health(server.base_url, 2.0)
        if health is not None and health[0] and health[1] != str(proc.pid):
            who = f"pid {health[1]}" if health[1] else "a process that is not an asyncgrpo server"
            raise PortTaken(
                f"{server.base_url} is answered by {who}, not by the server just started (pid {proc.pid}); "
                "give it a free --port"
            )
        if health is not None and health[0] and not exited:
            return server
        if exited:
            raise RuntimeError(
                f"the generation server exited with code {proc.returncode} during start-up:\n{server.log_tail()}"
            )
        time.sleep(0.25)
    server.stop()
    raise TimeoutError(
        f"waited {timeout:.0f}s for the generation server at {server.base_url}/health; log tail:\n{server.log_tail()}"
    )

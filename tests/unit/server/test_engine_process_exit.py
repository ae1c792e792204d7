"""Shutting down the engine process waits for the process itself, not only for its sentinel.

On the GPU machine a server's shutdown logged "the engine process did not stop within 60 s; killing it" 1 ms
after it started waiting: ``Process.join`` returns once the child's sentinel closes, which happens with its file
descriptors, while the kernel may still be tearing a CUDA context down. A real child process that closes its
end of the sentinel early (by exiting through a grandchild that keeps running) is awkward to build portably, so
this drives ``_wait_exit`` with a process whose ``join`` returns at once, as the sentinel did there.
"""

from __future__ import annotations

import time

from asyncgrpo.server.engine.process import RemoteEngine


class _EarlySentinel:
    """``join`` never blocks; the process reads as alive for ``alive_s`` seconds."""

    def __init__(self, alive_s: float) -> None:
        self.until = time.monotonic() + alive_s
        self.joins = 0

    def join(self, timeout: float | None = None) -> None:
        self.joins += 1

    def is_alive(self) -> bool:
        return time.monotonic() < self.until


def _engine(proc: _EarlySentinel) -> RemoteEngine:
    engine = RemoteEngine.__new__(RemoteEngine)  # no engine process: only the wait is under test
    engine._proc = proc
    return engine


def test_wait_exit_waits_for_the_process_after_an_early_join() -> None:
    proc = _EarlySentinel(alive_s=0.3)
    t0 = time.monotonic()
    assert _engine(proc)._wait_exit(5.0) is True
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 1.5, waited
    assert proc.joins >= 2  # it went back to waiting instead of giving up after the first join


def test_wait_exit_gives_up_at_its_deadline() -> None:
    t0 = time.monotonic()
    assert _engine(_EarlySentinel(alive_s=60.0))._wait_exit(0.25) is False
    assert 0.25 <= time.monotonic() - t0 < 1.5

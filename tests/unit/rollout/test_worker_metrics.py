"""Metric events of the rollout worker travel in batches: real child processes, the trainer's ``drain_metrics``.

Reference: the events the child's loop put, in the order it put them (written out by the loop itself).
"""

from __future__ import annotations

import asyncio
import threading
import time

from asyncgrpo.rollout import worker_child as worker_module
from asyncgrpo.rollout.worker import RolloutWorker


def _expected(n: int) -> list[tuple[str, float, float]]:
    return [(f"rollout/test_{i % 7}", float(i), float(1 + i % 3)) for i in range(n)]


class BurstThenEndLoop:
    """Puts ``n`` events (a quarter from a reward-like thread) with the periodic flush pushed out of reach, then
    ends: only the flush when the loop ends can deliver what is still collected."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def run(self, channels) -> None:
        worker_module.METRIC_FLUSH_INTERVAL_S = 3600.0  # the flusher's next sleep (in this child) never ends
        await asyncio.sleep(0.2)  # its first 50 ms sleep is over: it sleeps the long one now
        events = _expected(self.n)
        quarter = self.n // 4
        thread = threading.Thread(target=lambda: [channels.put_metric(*e) for e in events[:quarter]])
        thread.start()
        thread.join()
        for e in events[quarter:]:
            channels.put_metric(*e)


class SteadyLoop:
    """Puts one event every few milliseconds until stopped; the periodic flush delivers them while it runs."""

    async def run(self, channels) -> None:
        i = 0
        while not channels.stop.is_set():
            channels.put_metric("rollout/test_count", float(i))
            i += 1
            await asyncio.sleep(0.005)


def _drain_until(w: RolloutWorker, n: int, timeout: float) -> list[tuple[str, float, float]]:
    got: list[tuple[str, float, float]] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += w.drain_metrics()
        time.sleep(0.02)
    return got


def test_events_collected_at_the_end_arrive_in_order_after_the_loop_ends():
    w = RolloutWorker(BurstThenEndLoop(400), heartbeat_timeout=30)
    w.start()
    try:
        w.process.join(30)  # the loop ended: the child exits after its last flush
        assert w.process.exitcode == 0
        got = _drain_until(w, 400, 10)
    finally:
        w.stop()
    assert got == _expected(400)


def test_the_periodic_flush_delivers_events_while_the_loop_runs_and_batches_them():
    w = RolloutWorker(SteadyLoop(), heartbeat_timeout=30)
    w.start()
    try:
        got = _drain_until(w, 20, 20)
        assert w.process.is_alive()  # delivered while the loop still runs, not at its end
    finally:
        w.stop()
    assert len(got) >= 20
    assert [v for _, v, _ in got] == [float(i) for i in range(len(got))]  # in order, none lost or repeated


def test_drain_metrics_reads_batches_and_single_events_in_queue_order():
    """A single ``(name, value, weight)`` event put on the queue directly (an older loop) still reads."""
    w = RolloutWorker(SteadyLoop(), heartbeat_timeout=30)  # never started: only its queues are used
    ch = w.channels
    ch.metrics.put(("rollout/a", 1.0, 1.0))
    ch.put_metric("rollout/b", 2, 3)
    ch.put_metric("rollout/c", 4.0)
    ch.flush_metrics()
    ch.flush_metrics()  # nothing collected: nothing put
    ch.metrics.put(("rollout/d", 5.0, 1.0))
    got = _drain_until(w, 4, 10)
    assert got == [("rollout/a", 1.0, 1.0), ("rollout/b", 2.0, 3.0), ("rollout/c", 4.0, 1.0), ("rollout/d", 5.0, 1.0)]

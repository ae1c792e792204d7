"""The worker process plumbing: spawn, samples, heartbeat, failures — with real child processes."""

from __future__ import annotations

import asyncio
import atexit
import os
import sys
import time
from pathlib import Path

import pytest

from asyncgrpo.rollout.worker import RolloutWorker, RolloutWorkerError


class CountingLoop:
    """Emits n samples carrying the policy version it sees and the child's CUDA_VISIBLE_DEVICES."""

    def __init__(self, n: int) -> None:
        self.n = n

    async def run(self, channels) -> None:
        for i in range(self.n):
            channels.samples.put(
                {"i": i, "version": channels.policy_version.value, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}
            )
            channels.put_metric("rollout/test_count", 1)
            await asyncio.sleep(0.01)
        while not channels.stop.is_set():
            await asyncio.sleep(0.05)


class FloodingLoop:
    """Queues far more than a pipe holds (samples generated ahead of a step the trainer never takes), then waits.

    It also registers an exit hook in the child (as a user's reward module might) that writes ``marker``.
    """

    def __init__(self, marker: str) -> None:
        self.marker = marker

    async def run(self, channels) -> None:
        atexit.register(lambda: Path(self.marker).write_text("ran"))
        for i in range(40):
            channels.samples.put({"i": i, "payload": b"x" * 100_000})
            channels.put_metric("rollout/test_count", 1)
        while not channels.stop.is_set():
            await asyncio.sleep(0.02)


class ImportsSeenLoop:
    """Emits which heavy modules the child had imported when this loop was unpickled (its module imports none)."""

    def __init__(self) -> None:
        self.seen: list[str] = []  # a non-empty state: pickle calls __setstate__ only for one

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.seen = sorted(m for m in ("asyncgrpo.rollout.loop", "torch", "transformers") if m in sys.modules)

    async def run(self, channels) -> None:
        channels.samples.put({"seen": self.seen})
        while not channels.stop.is_set():
            await asyncio.sleep(0.05)


class FailingLoop:
    async def run(self, channels) -> None:
        await asyncio.sleep(0.05)
        raise ValueError("reward function 'my_reward' returned 3 values for 4 completions")


class BlockingLoop:
    """Blocks its event loop (a sync reward that never returns), so the heartbeat stops."""

    async def run(self, channels) -> None:
        await asyncio.sleep(0.2)
        time.sleep(60)  # noqa: ASYNC251 - blocking the event loop is the point of this test


class GcProbeLoop:
    """Counts the full collections between its unpickling in the child and its ``run``, and the frozen objects."""

    def __init__(self) -> None:
        self.full: list[int] = []  # some state, so that unpickling calls __setstate__

    def __setstate__(self, state: dict) -> None:
        import gc

        self.__dict__.update(state)
        self.full = []
        gc.callbacks.append(
            lambda phase, info: self.full.append(1) if phase == "start" and info["generation"] == 2 else None
        )

    async def run(self, channels) -> None:
        import gc

        channels.samples.put({"full_collections": len(self.full), "frozen": gc.get_freeze_count()})
        while not channels.stop.is_set():
            await asyncio.sleep(0.05)


def test_the_child_freezes_its_start_up_objects_without_walking_them_first():
    """No full collection between taking the loop and running it (one walked ~180 k objects for 0.14-0.19 s, all of
    it in the first group's time), and the start-up objects are frozen out of later collections."""
    w = RolloutWorker(GcProbeLoop(), heartbeat_timeout=30)
    w.start()
    try:
        got = w.get_sample(timeout=60)
    finally:
        w.stop()
    assert got["full_collections"] == 0
    assert got["frozen"] > 10_000


def test_samples_flow_and_child_is_cpu_only():
    w = RolloutWorker(CountingLoop(3), heartbeat_timeout=30)
    w.set_policy_version(7)
    w.start()
    try:
        got = [w.get_sample(timeout=60) for _ in range(3)]
        assert [g["i"] for g in got] == [0, 1, 2]
        assert all(g["version"] == 7 for g in got)
        assert all(g["cuda"] == "" for g in got)
        time.sleep(0.2)
        assert ("rollout/test_count", 1.0, 1.0) in w.drain_metrics()
        w.check()
    finally:
        w.stop()
    assert not w.process.is_alive()


def test_a_worker_spawned_ahead_takes_its_loop_later_or_exits_when_stopped():
    """spawn() starts the child (its imports run meanwhile); start() hands the loop over later; the policy version
    set in between reaches it. A child spawned but never started exits at stop() without an error report."""
    w = RolloutWorker(None, heartbeat_timeout=30)  # as the trainer spawns it ahead: the loop comes later
    w.spawn()
    assert w.process is not None and w.process.is_alive() and not w.started
    with pytest.raises(RolloutWorkerError, match="never started"):
        w.check()
    with pytest.raises(RuntimeError, match="adopt"):
        w.start()
    time.sleep(0.5)
    w.set_policy_version(3)
    w.adopt(CountingLoop(2)).start()
    try:
        assert [w.get_sample(timeout=60)["version"] for _ in range(2)] == [3, 3]
        with pytest.raises(RuntimeError, match="started already"):
            w.start()
    finally:
        w.stop()
    idle = RolloutWorker(CountingLoop(1), heartbeat_timeout=30)
    idle.spawn()
    t0 = time.monotonic()
    idle.stop()
    assert not idle.process.is_alive() and idle.process.exitcode == 0  # 1 would mean it reported an error
    assert time.monotonic() - t0 < 9  # it saw the closed pipe; stop() did not wait out its 10 s and terminate it


def test_a_child_imports_what_a_loop_needs_before_the_loop_arrives():
    """Spawned ahead, the child imports torch, transformers and the loop's modules while it waits: unpickling the
    loop at start() no longer pays for them inside the first group's time."""
    w = RolloutWorker(None, heartbeat_timeout=60)
    w.spawn()
    w.adopt(ImportsSeenLoop()).start()
    try:
        assert w.get_sample(timeout=60)["seen"] == ["asyncgrpo.rollout.loop", "torch", "transformers"]
    finally:
        w.stop()


def test_child_exception_reaches_the_trainer_with_its_traceback():
    w = RolloutWorker(FailingLoop(), heartbeat_timeout=30)
    w.start()
    try:
        with pytest.raises(RolloutWorkerError, match="my_reward") as info:
            w.get_sample(timeout=60)
        assert "Traceback" in str(info.value)
    finally:
        w.stop()


def test_killed_worker_stops_the_trainer_wait():
    w = RolloutWorker(CountingLoop(0), heartbeat_timeout=30)
    w.start()
    try:
        time.sleep(1.0)
        w.process.kill()
        t0 = time.monotonic()
        with pytest.raises(RolloutWorkerError, match="exited unexpectedly"):
            w.get_sample(timeout=60)
        assert time.monotonic() - t0 < 5
    finally:
        w.stop()


def test_stale_heartbeat_is_an_error():
    w = RolloutWorker(BlockingLoop(), heartbeat_timeout=2.0)
    w.start(timeout=120)  # the child imports torch and transformers before it takes the loop
    try:
        with pytest.raises(RolloutWorkerError, match="heartbeat"):
            w.get_sample(timeout=30)
    finally:
        w.stop(timeout=2)


def test_timeout_names_what_it_waited_for():
    w = RolloutWorker(CountingLoop(0), heartbeat_timeout=30)
    w.start()
    try:
        with pytest.raises(TimeoutError, match="rollout worker's queue"):
            w.get_sample(timeout=1.0)
    finally:
        w.stop()


def test_stop_ends_a_worker_with_unread_samples_at_once(tmp_path):
    """Samples the trainer will never read do not hold the child's exit: it ends cleanly, not terminated, and
    runs its exit hooks."""
    w = RolloutWorker(FloodingLoop(str(tmp_path / "hook")), heartbeat_timeout=30)
    w.start()
    try:
        assert w.get_sample(timeout=60)["i"] == 0
        time.sleep(0.5)  # the child has queued the rest, 3.9 MB, into a pipe nobody empties
        t0 = time.monotonic()
        w.stop(timeout=10)
        took = time.monotonic() - t0
    finally:
        if w.process.is_alive():
            w.process.kill()
    assert w.process.exitcode == 0, w.process.exitcode  # terminate() would give -15
    assert took < 5, f"stop() took {took:.1f}s"
    assert (tmp_path / "hook").read_text() == "ran"

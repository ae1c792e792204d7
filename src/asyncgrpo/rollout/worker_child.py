"""The rollout worker's child process, and the channels it shares with the trainer (G1, G11, X4).

``RolloutWorker`` (``worker.py``) spawns :func:`child_main`; the child imports what a loop needs, takes its loop
over a pipe, and runs it on an asyncio loop beside a heartbeat and a metric flusher, until the trainer's stop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing as mp
import os
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_ready
from multiprocessing.reduction import ForkingPickler
from typing import Any, Protocol

from asyncgrpo.process_exit import exit_without_teardown

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0  # how often the child stamps the heartbeat
METRIC_FLUSH_INTERVAL_S = 0.05  # how often the child hands its collected metric events to the trainer
PARENT_CHECK_INTERVAL_S = 0.5  # how often the child re-checks that its trainer still lives


class RolloutLoopLike(Protocol):
    """What the worker needs from a rollout loop: one coroutine that runs until stopped."""

    async def run(self, channels: WorkerChannels) -> None: ...


@dataclass
class WorkerChannels:
    """The shared objects a child receives (picklable across a spawn)."""

    samples: Any  # mp.Queue
    metrics: Any  # mp.Queue
    errors: Any  # mp.Queue
    stop: Any  # mp.Event
    policy_version: Any  # mp.Value("q")
    tokens_per_step: Any  # mp.Value("q"), 0 before the first step
    tokens_consumed: Any  # mp.Value("q"), total tokens the trainer pulled from `samples`
    heartbeat: Any  # mp.Value("d")
    samples_queued: Any = None  # mp.Value("q"): samples put in `samples` minus samples the trainer pulled
    trainer_waiting: Any = None  # mp.Event: set while the trainer waits for a step's samples (sync_rollouts)
    dropped_servers: Any = None  # mp.Value("q"): bit i set = the trainer dropped server i from the weight sync (X5)

    def dropped_server_mask(self) -> int:
        return int(self.dropped_servers.value) if self.dropped_servers is not None else 0

    def count_queued(self, delta: int) -> None:
        if self.samples_queued is not None:
            with self.samples_queued.get_lock():
                self.samples_queued.value += int(delta)

    def __post_init__(self) -> None:
        self._pending: list[tuple[str, float, float]] = []  # events not yet handed to ``metrics``
        self._pending_lock = threading.Lock()  # put_metric may run in a reward or tool thread

    def __getstate__(self) -> dict[str, Any]:
        # A spawned child starts with no pending events of its own (and a lock cannot pickle).
        state = dict(self.__dict__)
        del state["_pending"], state["_pending_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    def put_metric(self, name: str, value: float, weight: float = 1.0) -> None:
        """Add one ``(name, value, weight)`` metric event for the trainer's logging window.

        Events collect here and go to the trainer as one list per :meth:`flush_metrics` (the worker flushes after
        every scored group and every :data:`METRIC_FLUSH_INTERVAL_S`): a queue put per event woke the queue's
        feeder thread, which pickled each tuple and took the GIL from the event loop, for several events per request.
        """
        event = (name, float(value), float(weight))
        with self._pending_lock:
            self._pending.append(event)

    def flush_metrics(self) -> None:
        """Hand the collected metric events to the trainer, in the order they were put, as one queue item."""
        with self._pending_lock:
            if not self._pending:
                return
            batch, self._pending = self._pending, []
        self.metrics.put(batch)


async def _beat(channels: WorkerChannels) -> None:
    while True:
        channels.heartbeat.value = time.time()
        await asyncio.sleep(HEARTBEAT_INTERVAL_S)


async def _flush_metrics(channels: WorkerChannels) -> None:
    while True:
        await asyncio.sleep(METRIC_FLUSH_INTERVAL_S)
        channels.flush_metrics()


async def _run_child(loop_obj: RolloutLoopLike, channels: WorkerChannels) -> None:
    beat = asyncio.create_task(_beat(channels))
    flush = asyncio.create_task(_flush_metrics(channels))
    try:
        await loop_obj.run(channels)
    finally:
        beat.cancel()
        flush.cancel()
        channels.flush_metrics()  # nothing the loop measured is lost when it stops


def _watch_parent(parent_pid: int) -> None:
    """Exit this process as soon as the trainer that spawned it is gone, whatever killed it (SIGKILL included).

    A spawned child holds the read end of a pipe whose write end only its parent holds: the pipe turns readable
    (EOF) when the parent dies. The parent pid changing (re-parented to init) is a second, independent sign.
    Without this watch the worker would outlive a killed trainer and keep sending requests to the server.
    """
    parent = mp.parent_process()
    sentinel = parent.sentinel if parent is not None else None
    while True:
        if sentinel is not None:
            gone = bool(wait_ready([sentinel], timeout=PARENT_CHECK_INTERVAL_S))
        else:
            time.sleep(PARENT_CHECK_INTERVAL_S)
            gone = False
        if gone or os.getppid() != parent_pid:
            logger.error("the trainer process (pid %d) is gone; the rollout worker stops", parent_pid)
            logging.shutdown()
            os._exit(3)  # no clean-up: the trainer that would read our queues no longer exists


def child_main(loop_conn: Any, channels: WorkerChannels, parent_pid: int) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s rollout-worker: %(message)s")
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="watch-trainer", daemon=True).start()
    channels.heartbeat.value = time.time()
    _import_ahead()
    try:
        payload = loop_conn.recv_bytes()
    except EOFError:  # spawned ahead (RolloutWorker.spawn), then stopped before it got a loop: nothing to report
        exit_without_teardown(0)
    try:
        loop_obj = ForkingPickler.loads(payload)
        loop_conn.send_bytes(b"ok")  # the trainer's start() returns on this
        loop_conn.close()
        # Imports, the dataset and the tokenizer leave the collector's scans (see Engine.start). No collection
        # first: it finds a few dozen unreachable objects among ~180 k and walks them all for 0.14-0.19 s, every
        # one of them in the first group's time (the trainer's start() has returned), while freezing those few
        # costs nothing worth that.
        gc.freeze()
        asyncio.run(_run_child(loop_obj, channels))
    except BaseException:  # noqa: BLE001 - process boundary: everything goes back to the trainer
        channels.errors.put(traceback.format_exc())
        _drop_unread_when_stopped(channels)
        channels.errors.close()
        channels.errors.join_thread()  # the traceback is in the pipe before the process ends
        # No interpreter teardown: the trainer shows the traceback, and teardown after a failure printed dozens of
        # nanobind "leaked instance" lines from triton's bindings in front of it.
        exit_without_teardown(1)
    if channels.stop.is_set():
        _drop_unread_when_stopped(channels)
        exit_without_teardown(0)  # nothing is left to hand over; the trainer waits for this exit


def _import_ahead() -> None:
    """Import what unpickling a rollout loop imports (torch, transformers, the loop's and the tokenizer's modules)
    before the loop arrives. A child spawned ahead (:meth:`RolloutWorker.spawn`) does it while the trainer builds
    its parts and pushes the first weights; unpickling the loop then takes 0.1 s instead of the seconds of these
    imports (2.5 s on 2 CPU cores, 3-3.8 s on an H200 machine: the first generation waited for them)."""
    try:
        import transformers

        import asyncgrpo.rollout.loop  # noqa: F401 - imports torch and the loop's modules

        transformers.PreTrainedTokenizerFast  # noqa: B018 - a lazy attribute: imports the fast tokenizers' module
    except Exception as exc:  # noqa: BLE001 - the unpickling below meets the same import and reports it in context
        logger.debug("importing ahead failed: %s", exc)


def _drop_unread_when_stopped(channels: WorkerChannels) -> None:
    """Once the trainer asked us to stop it reads no more samples or metrics: do not wait to flush them.

    A queue's feeder thread writes into a pipe; at exit the process waits for it to push everything out. With
    the trainer gone from the other end and more than a pipe's worth left (samples generated ahead of the last
    step), that wait never ends and ``RolloutWorker.stop`` had to time out and terminate the child (10 s at the
    end of every run). The error queue is kept: a traceback must still reach the trainer.
    """
    if channels.stop.is_set():
        channels.samples.cancel_join_thread()
        channels.metrics.cancel_join_thread()

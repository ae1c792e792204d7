"""The rollout worker process: spawn, shared state, heartbeat and failure propagation (G1, G11, X4).

Trainer rank 0 owns a :class:`RolloutWorker`. It spawns a CPU-only child
(``CUDA_VISIBLE_DEVICES=""``) that runs an asyncio loop around the user's
rollout loop object. Everything crosses by pickling, so the loop object and
all it holds must pickle; the child re-imports the user's script, which is why
scripts need the ``if __name__ == "__main__":`` guard.

Shared state (all created here, never by the child):

* ``samples``: scored training samples, child → trainer.
* ``metrics``: lists of ``(name, value, weight)`` events, child → trainer (batched: see ``put_metric``).
* ``policy_version``, ``tokens_per_step``, ``tokens_consumed``: trainer → child.
* ``heartbeat``: the child's last sign of life (``time.time()``), checked by the trainer.
* ``errors``: the child's traceback when its loop raises.

The child's side (its entry point, heartbeat, parent watch) is ``worker_child.py``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

from asyncgrpo.rollout.worker_child import RolloutLoopLike, WorkerChannels, child_main

__all__ = ["GUARD_HINT", "RolloutLoopLike", "RolloutWorker", "RolloutWorkerError", "WorkerChannels"]

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.2  # how often a blocking trainer wait re-checks the child's health
START_LOG_INTERVAL_S = 30.0  # X4: a line at least this often while the worker starts
GUARD_HINT = (
    "the rollout worker is a spawned process that re-imports your script when it starts; if the script builds "
    'or trains the AsyncGRPOTrainer at import time, put that code under `if __name__ == "__main__":`'
)


class RolloutWorkerError(RuntimeError):
    """The rollout worker failed; the message carries the child's traceback."""


class RolloutWorker:
    """Trainer-side handle of the rollout worker process.

    Args:
        loop_obj: the rollout loop (must pickle; see ``check_picklable`` in ``rollout.rewards``).
        heartbeat_timeout: seconds without a heartbeat after which the worker counts as dead
            (the config's ``rollout_worker_timeout``).
        queue_size: bound of the sample queue (0 = unbounded; admission already bounds it in tokens).
    """

    def __init__(self, loop_obj: RolloutLoopLike | None, heartbeat_timeout: float = 300.0, queue_size: int = 0) -> None:
        self._ctx = mp.get_context("spawn")
        ctx = self._ctx
        self.channels = WorkerChannels(
            samples=ctx.Queue(queue_size),
            metrics=ctx.Queue(),
            errors=ctx.Queue(),
            stop=ctx.Event(),
            policy_version=ctx.Value("q", 0),
            tokens_per_step=ctx.Value("q", 0),
            tokens_consumed=ctx.Value("q", 0),
            heartbeat=ctx.Value("d", 0.0),
            samples_queued=ctx.Value("q", 0),
            trainer_waiting=ctx.Event(),
            dropped_servers=ctx.Value("q", 0),
        )
        self.loop_obj = loop_obj
        self.heartbeat_timeout = heartbeat_timeout
        self.process: mp.process.BaseProcess | None = None
        self._loop_end: Any = None  # our end of the loop pipe, between spawn() and start()
        self.started = False  # start() handed the child its loop

    def adopt(self, loop_obj: Any) -> RolloutWorker:
        """Give a worker made without a loop (spawned ahead, :meth:`spawn`) the loop :meth:`start` hands over."""
        if self.started:
            raise RuntimeError("this rollout worker runs a loop already")
        self.loop_obj = loop_obj
        return self

    def start(self, timeout: float | None = None) -> None:
        """Spawn the child and hand it the rollout loop; returns once the child holds the loop.

        The loop (dataset, tokenizer, reward functions) is sent after the spawn over a pipe of our own rather than
        as a ``Process`` argument: multiprocessing writes the arguments with a blocking write that never returns
        when the child dies while it re-imports the script (a missing ``__main__`` guard), because the parent
        holds the pipe's read end too. Our pipe's read end is closed here, so a dead child is seen at once.

        Raises:
            RolloutWorkerError: the child exited before it received the loop (the guard hint says the usual cause).
            TimeoutError: the child did not take the loop within ``timeout`` seconds (default: the heartbeat timeout).
        """
        if self.started:
            raise RuntimeError("this rollout worker was started already; make a new RolloutWorker to run again")
        if self.loop_obj is None:
            raise RuntimeError("this rollout worker has no loop to run: give it one with adopt(loop) first")
        timeout = self.heartbeat_timeout if timeout is None else timeout
        try:
            payload = ForkingPickler.dumps(self.loop_obj)  # fails here, in the trainer, if the loop cannot pickle
        except Exception:
            self._close_unused_spawn()
            raise
        self.spawn()
        # The child stamps the heartbeat once it runs; until then its age counts from the hand-over, not from 1970.
        self.channels.heartbeat.value = time.time()
        our_end, self._loop_end = self._loop_end, None
        self._hand_over(our_end, bytes(payload), timeout)
        self.started = True

    def spawn(self) -> None:
        """Start the child process now; :meth:`start` hands it the loop later (idempotent).

        A spawned child re-imports torch, transformers and the user's script before it can take a loop: seconds
        that, spawned ahead (the trainer does while it prepares the model and pushes the first weights), are not
        spent in the first step."""
        if self.process is not None:
            return
        child_end, self._loop_end = self._ctx.Pipe(duplex=True)
        self.channels.heartbeat.value = time.time()
        self.process = self._ctx.Process(
            target=child_main,
            args=(child_end, self.channels, os.getpid()),
            name="asyncgrpo-rollout-worker",
            daemon=True,
        )
        # The child must never touch a GPU: hide them while it is spawned (it inherits this environment).
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            self.process.start()
        except RuntimeError as e:
            if "bootstrapping phase" in str(e) or "freeze_support" in str(e):
                raise RuntimeError(GUARD_HINT) from e
            raise
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        child_end.close()
        # The trainer only reads these queues. Dropping its copy of their write ends means a child killed in the
        # middle of a message gives EOF here instead of a read that blocks forever on the missing bytes.
        for q in (self.channels.samples, self.channels.metrics, self.channels.errors):
            q._writer.close()

    def _close_unused_spawn(self) -> None:
        """A child spawned ahead that will get no loop: closing our pipe end lets it exit (EOF) at once."""
        if self._loop_end is not None:
            self._loop_end.close()
            self._loop_end = None

    def _hand_over(self, conn: Any, payload: bytes, timeout: float) -> None:
        """Send the loop and wait for the child's acknowledgement, watching the child and the clock meanwhile."""
        failure: list[BaseException] = []

        def send() -> None:
            try:
                conn.send_bytes(payload)
                conn.recv_bytes()
            except (EOFError, OSError) as e:
                failure.append(e)
            finally:
                conn.close()

        sender = threading.Thread(target=send, name="rollout-loop-handover", daemon=True)  # send/recv block
        sender.start()
        t0 = time.monotonic()
        next_log = t0 + START_LOG_INTERVAL_S
        while sender.is_alive() or failure:
            sender.join(POLL_INTERVAL_S)
            assert self.process is not None
            if failure or (sender.is_alive() and not self.process.is_alive()):
                self.process.join(timeout=5.0)
                raise RolloutWorkerError(
                    f"the rollout worker exited (exit code {self.process.exitcode}) while it started, before it "
                    f"received its rollout loop; its error is printed above. Usual cause: {GUARD_HINT}"
                )
            now = time.monotonic()
            if now - t0 > timeout:
                self.process.kill()
                raise TimeoutError(
                    f"the rollout worker (pid {self.process.pid}) did not take its rollout loop within {timeout:.0f}s "
                    f"(rollout_worker_timeout); it may still be importing your script. {GUARD_HINT}"
                )
            if now >= next_log:
                logger.info("waiting for the rollout worker (pid %d) to start: %.0fs so far (timeout %.0fs)",
                            self.process.pid, now - t0, timeout)  # fmt: skip
                next_log = now + START_LOG_INTERVAL_S

    # ---- trainer -> worker
    def set_policy_version(self, version: int) -> None:
        self.channels.policy_version.value = version

    def set_trainer_waiting(self, waiting: bool) -> None:
        """Open (True) or close the gate a ``sync_rollouts`` worker starts groups through."""
        if self.channels.trainer_waiting is not None:
            (self.channels.trainer_waiting.set if waiting else self.channels.trainer_waiting.clear)()

    def drop_server(self, index: int) -> None:
        """Tell the loop to stop routing to server ``index``: the weight sync no longer reaches it (X5)."""
        with self.channels.dropped_servers.get_lock():
            self.channels.dropped_servers.value |= 1 << index

    def report_step(self, tokens_used: int) -> None:
        self.channels.tokens_per_step.value = int(tokens_used)

    def report_consumed(self, tokens: int) -> None:
        with self.channels.tokens_consumed.get_lock():
            self.channels.tokens_consumed.value += int(tokens)

    # ---- health
    def check(self) -> None:
        """Raise :class:`RolloutWorkerError` if the child failed, exited or stopped beating."""
        try:
            tb = self.channels.errors.get_nowait()
        except (queue.Empty, EOFError, OSError):
            tb = None
        if tb is not None:
            raise RolloutWorkerError(f"the rollout worker failed:\n{tb}")
        if self.process is None or not self.started:
            raise RolloutWorkerError("the rollout worker was never started")
        if not self.process.is_alive():
            raise RolloutWorkerError(f"the rollout worker exited unexpectedly (exit code {self.process.exitcode})")
        age = time.time() - self.channels.heartbeat.value
        if age > self.heartbeat_timeout:
            raise RolloutWorkerError(
                f"the rollout worker's heartbeat is {age:.0f}s old (rollout_worker_timeout={self.heartbeat_timeout:.0f}s); "
                "its event loop is blocked or the process hangs"
            )

    def get_sample(self, timeout: float) -> Any:
        """Next scored sample; waits at most ``timeout`` seconds, checking the child's health meanwhile.

        Raises:
            RolloutWorkerError: the child failed or died while we waited.
            TimeoutError: no sample arrived from the rollout worker's queue within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.channels.samples.get(timeout=min(POLL_INTERVAL_S, max(deadline - time.monotonic(), 0.001)))
            except queue.Empty:
                pass
            except (EOFError, OSError) as e:  # the child died while writing: report why
                if self.process is not None:
                    self.process.join(timeout=5.0)  # let it be reaped so check() sees the exit code
                self.check()
                raise RolloutWorkerError(f"the rollout worker's sample queue broke: {e!r}") from e
            self.check()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"waited {timeout:.0f}s for a sample from the rollout worker's queue")

    def queue_size(self) -> int:
        """Training samples waiting in the sample queue (``rollout/queue_size`` counts samples, not groups)."""
        return int(self.channels.samples_queued.value)

    def drain_metrics(self) -> list[tuple[str, float, float]]:
        """Every metric event the child has handed over so far, in the order it put them."""
        out: list[tuple[str, float, float]] = []
        while True:
            try:
                item = self.channels.metrics.get_nowait()
            except (queue.Empty, EOFError, OSError):
                return out
            if isinstance(item, list):  # a batch (flush_metrics)
                out += item
            else:  # a single event, put on the queue directly
                out.append(item)

    def stop(self, timeout: float = 10.0) -> None:
        self.channels.stop.set()
        self._close_unused_spawn()
        if self.process is not None and self.process.is_alive():
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("the rollout worker (pid %d) did not exit within %.0fs of the stop signal; terminating it",
                               self.process.pid, timeout)  # fmt: skip
                self.process.terminate()
                self.process.join(timeout)

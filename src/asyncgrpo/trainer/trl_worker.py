"""TRL 1.16's ``rollout_worker=`` plug-in: its ``RolloutWorkerProtocol`` object as this trainer's rollout worker.

The object has ``start()``, ``stop()``, ``update_model_version(version)``, ``check_health(stale_after_s)``, a
``rollout_buffer`` queue of scored samples (TRL's ``RolloutSample`` fields: ``input_ids``, ``completion_mask``,
``old_log_probs`` aligned with ``input_ids``, ``advantage``, ``model_version``, ``group_id``; ``metrics`` and
``enqueued_at`` optional) and optionally a ``metrics_queue`` of ``{name: value}`` or ``{name: (numerator,
denominator)}`` dicts. :class:`TRLWorkerHost` gives it the face ``RolloutSource`` and the trainer use of our
``RolloutWorker`` (``rollout/worker.py``): the samples of one ``group_id`` that arrive together become one group
result, the version handed to ``update_model_version`` is the optimizer step whose weights the server now holds
(the stamp our staleness counts in), and ``check_health`` is called with ``heartbeat_stale_after_s`` (alias
``rollout_worker_timeout``) while the trainer waits. The samples carry no sampler top-N log-probs, so they train
with the clipped surrogate (TRL's loss) whatever ``score_centering`` says.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Any

from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.types import TrainingSequence

logger = logging.getLogger(__name__)

ROLLOUT_WORKER_METHODS = ("start", "stop", "update_model_version", "check_health")
POLL_S = 0.2  # how often a trainer waiting for samples asks the worker's check_health
GROUP_GATHER_S = 0.05  # how long the rest of a group (same group_id) may trail its first sample in the queue


def check_rollout_worker_protocol(obj: Any) -> None:
    """Raise ``TypeError`` naming the first ``RolloutWorkerProtocol`` member ``obj`` lacks."""
    missing = [m for m in ROLLOUT_WORKER_METHODS if not callable(getattr(obj, m, None))]
    if not hasattr(obj, "rollout_buffer"):
        missing.append("rollout_buffer")
    if missing:
        first = missing[0] if missing[0] == "rollout_buffer" else f"{missing[0]}()"
        kind = "attribute" if missing[0] == "rollout_buffer" else "method"
        raise TypeError(
            f"rollout_worker={type(obj).__name__} has no {kind} {first} (TRL 1.16's RolloutWorkerProtocol needs "
            f"{', '.join(ROLLOUT_WORKER_METHODS)} and a rollout_buffer queue; missing: {', '.join(missing)})"
        )


class _Counter:
    """Stands in for the ``samples_queued`` channel of our worker (``RolloutSource`` decrements it)."""

    def count_queued(self, delta: int) -> None:
        pass


class TRLWorkerHost:
    """Our ``RolloutWorker``'s trainer-side interface over a TRL 1.16 rollout worker (see the module docstring).

    Args:
        worker: the user's object.
        stale_after_s: ``heartbeat_stale_after_s``, handed to ``check_health``.
        first_row: the first group's row index (after a resume, past every prompt the checkpoint settled).
    """

    def __init__(self, worker: Any, stale_after_s: float, first_row: int = 0) -> None:
        check_rollout_worker_protocol(worker)
        self.worker, self.stale_after_s = worker, stale_after_s
        self.channels = _Counter()
        self.process: Any = None  # not None once started (the trainer starts a worker once)
        self._next_row = first_row
        self._held: Any = None  # the first sample of the next group, read while gathering the previous one

    # ---- lifecycle
    def start(self, timeout: float | None = None) -> None:
        self.worker.start()
        self.process = self.worker

    @property
    def started(self) -> bool:
        return self.process is not None

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is not None:
            self.process = None
            self.worker.stop()

    # ---- trainer -> worker
    def set_policy_version(self, version: int) -> None:
        self.worker.update_model_version(int(version))

    def set_trainer_waiting(self, waiting: bool) -> None:
        pass  # sync_rollouts gates our own loop only

    def drop_server(self, index: int) -> None:
        pass

    def report_step(self, tokens_used: int) -> None:
        pass

    def report_consumed(self, tokens: int) -> None:
        pass

    def queue_size(self) -> int:
        try:
            return int(self.worker.rollout_buffer.qsize())
        except (NotImplementedError, AttributeError):  # macOS multiprocessing queues have no qsize
            return 0

    # ---- worker -> trainer
    def check(self) -> None:
        self.worker.check_health(self.stale_after_s)

    def get_sample(self, timeout: float) -> GroupResult:
        """The next group: its first sample (waiting at most ``timeout``), then those of its ``group_id`` right behind.

        Raises:
            TimeoutError: no sample within ``timeout`` (``check_health`` is asked meanwhile and raises first).
        """
        first = self._held if self._held is not None else self._next(timeout)
        self._held = None
        samples = [first]
        while True:
            try:
                sample = self.worker.rollout_buffer.get(timeout=GROUP_GATHER_S)
            except queue.Empty:
                break
            if sample.group_id != first.group_id:
                self._held = sample
                break
            samples.append(sample)
        row = self._next_row
        self._next_row += 1
        sequences = [self._sequence(s, row) for s in samples]
        return GroupResult(
            row_index=row,
            epoch=0,
            group_id=int(first.group_id),
            model_version=min(s.model_version for s in sequences),
            sequences=sequences,
            queued_at=float(getattr(first, "enqueued_at", None) or time.time()),  # time.time(), as ours
            tokens=sum(len(s.input_ids) for s in sequences),
        )

    def _next(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.worker.rollout_buffer.get(timeout=min(POLL_S, max(deadline - time.monotonic(), 0.001)))
            except queue.Empty:
                pass
            self.check()
            if time.monotonic() >= deadline:
                raise TimeoutError(f"waited {timeout:.0f}s for a sample from the rollout worker's rollout_buffer")

    @staticmethod
    def _sequence(sample: Any, row: int) -> TrainingSequence:
        ids = [int(t) for t in sample.input_ids]
        mask = [int(m) for m in sample.completion_mask]
        logprobs = [float(x) for x in sample.old_log_probs]
        if not len(ids) == len(mask) == len(logprobs):
            raise ValueError(
                f"a rollout_buffer sample of group {sample.group_id} has {len(ids)} input_ids, {len(mask)} "
                f"completion_mask and {len(logprobs)} old_log_probs entries; all three must align with input_ids"
            )
        return TrainingSequence(input_ids=ids, loss_mask=mask, sampler_logprobs=logprobs,
                                advantage=float(sample.advantage), model_version=int(sample.model_version),
                                group_id=int(sample.group_id), row_index=row)  # fmt: skip

    def drain_metrics(self) -> list[tuple[str, float, float]]:
        """The worker's ``metrics_queue`` as our metric events: a value weighs 1, a (numerator, denominator) rate
        is its ratio weighted by the denominator (so a window's mean is the summed ratio)."""
        q = getattr(self.worker, "metrics_queue", None)
        out: list[tuple[str, float, float]] = []
        while q is not None:
            try:
                item = q.get_nowait()
            except (queue.Empty, EOFError, OSError):
                break
            for name, value in dict(item).items():
                if isinstance(value, tuple):
                    num, den = (float(v) for v in value)
                    if den > 0:
                        out.append((name, num / den, den))
                else:
                    out.append((name, float(value), 1.0))
        return out

"""The trainer's side of the rollout queue: pull, drop stale, plan rows, count prompts (G4, P2, T3, T5).

Rank 0 owns it. Each step it pulls group results from the worker, drops samples
more than ``max_staleness`` weight updates behind (G4), feeds the token-budget
planner until ``gradient_accumulation_steps`` micro-batches are closed, and after
the optimizer step marks the trained prompts consumed, which moves the epoch
count (T3) and the first untrained prompt that checkpoints record (T5).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from asyncgrpo.packing import MicroBatch, PackSample, TokenBudgetBatcher, plan_step
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.worker import RolloutWorker

logger = logging.getLogger(__name__)


@dataclass
class _Meta:
    """Rides on each PackSample (``meta``) so the trainer can account for it after the step."""

    row_index: int
    model_version: int
    queued_at: float
    num_tokens: int


class RolloutSource:
    """Turns the worker's group results into the micro-batches of one optimizer step.

    Args:
        worker: the running rollout worker.
        batcher: the token-budget planner (rows per micro-batch = number of processes).
        gradient_accumulation_steps: micro-batches per step.
        max_staleness: samples more weight updates behind than this are dropped at pull time.
        dataset_len: prompts per epoch.
        start_index: first untrained prompt (flat index over epochs) when resuming.
        total_prompts: stop once this many prompts are consumed (``num_train_epochs × len``), or None.
        sample_timeout: seconds to wait for one sample while the worker is healthy.
    """

    def __init__(
        self,
        worker: RolloutWorker,
        batcher: TokenBudgetBatcher,
        gradient_accumulation_steps: int,
        max_staleness: int,
        dataset_len: int,
        start_index: int = 0,
        total_prompts: int | None = None,
        sample_timeout: float = 1800.0,
    ) -> None:
        self.worker = worker
        self.batcher = batcher
        self.ga = gradient_accumulation_steps
        self.max_staleness = max_staleness
        self.dataset_len = dataset_len
        self.total_prompts = total_prompts
        self.sample_timeout = sample_timeout
        self.policy_version = 0
        self.first_untrained = start_index
        self._consumed: set[int] = set()
        self._pending: dict[int, int] = {}  # flat row index -> sequences not yet trained
        self._buffer: deque[PackSample] = deque()
        self._ended = False
        self.wait_s = 0.0  # seconds the current step waited on the worker's queue (perf/rollout_wait_s)
        self.completions_log: deque[GroupResult] = deque(maxlen=64)
        self.metrics: list[tuple[str, float, float]] = []

    @property
    def prompts_consumed(self) -> int:
        return self.first_untrained + len(self._consumed)  # _consumed holds only indices past the first gap

    @property
    def finished(self) -> bool:
        """All requested prompts are consumed, or the worker has no more data and nothing is left to train."""
        if self.total_prompts is not None and self.prompts_consumed >= self.total_prompts:
            return True
        return self._ended and not self._buffer and self.batcher.pending_samples == 0

    def _mark_consumed(self, row_index: int) -> None:
        if row_index < self.first_untrained:
            return  # already counted
        self._consumed.add(row_index)
        while self.first_untrained in self._consumed:
            self._consumed.discard(self.first_untrained)
            self.first_untrained += 1

    def _receive(self, timeout: float) -> None:
        """Pull one group result from the worker into the buffer (G4 stale drop happens here)."""
        t0 = time.perf_counter()
        res: GroupResult = self.worker.get_sample(timeout)
        self.wait_s += time.perf_counter() - t0
        if res.end:
            self._ended = True
            return
        # Pulled = no longer queued: the worker's token allowance (G3) frees now, not after the step, or a
        # step that needs more tokens than the allowance would wait forever for the worker.
        self.worker.report_consumed(res.tokens)
        if res.prompt_text is not None:
            self.completions_log.append(res)
        fresh = [s for s in res.sequences if not self._is_stale(s.model_version)]
        if len(fresh) < len(res.sequences):
            self.metrics.append(("sample/dropped_stale_count", float(len(res.sequences) - len(fresh)), 1.0))
        if not fresh:
            self._mark_consumed(res.row_index)
            return
        self._pending[res.row_index] = len(fresh)
        for s in fresh:
            meta = _Meta(res.row_index, s.model_version, res.queued_at, len(s.input_ids))
            self._buffer.append(PackSample.from_sequence(s, meta))

    def _is_stale(self, model_version: int) -> bool:
        return self.policy_version - model_version > self.max_staleness

    def _drop_stale(self, row_index: int, count: int) -> None:
        self.metrics.append(("sample/dropped_stale_count", float(count), 1.0))
        left = self._pending.get(row_index, 0) - count
        if left <= 0:
            self._pending.pop(row_index, None)
            self._mark_consumed(row_index)
        else:
            self._pending[row_index] = left

    def _pull(self) -> PackSample | None:
        while True:
            while not self._buffer:
                if self._ended or (self.total_prompts is not None and self._requested_enough()):
                    return None
                self._receive(self.sample_timeout)
            sample = self._buffer.popleft()
            # Samples wait in the buffer across steps (a group larger than what a step still takes): check here.
            if not self._is_stale(sample.meta.model_version):
                return sample
            self._drop_stale(sample.meta.row_index, 1)

    def _requested_enough(self) -> bool:
        # Everything needed to reach total_prompts is consumed or already placed in the planner.
        return self.prompts_consumed + len(self._pending) >= self.total_prompts

    def next_step(self, policy_version: int) -> list[MicroBatch]:
        """Micro-batches of the next step (fewer than ``gradient_accumulation_steps`` only at the end of data)."""
        self.policy_version = policy_version
        self.wait_s = 0.0
        # The sample that closed the last step waits in the planner; re-check it (and any others) against the
        # new version so no sample is trained more than max_staleness updates behind (G4).
        for sample in reversed(self.batcher.take_open_samples()):
            if self._is_stale(sample.meta.model_version):
                self._drop_stale(sample.meta.row_index, 1)
            else:
                self._buffer.appendleft(sample)
        self.metrics.append(("rollout/queue_size", float(self.worker.queue_size()), 1.0))
        return plan_step(self.batcher, self._pull, self.ga)

    def step_done(self, micro_batches: list[MicroBatch]) -> int:
        """Account for a finished optimizer step; returns the flat tokens it trained (G3's per-step report)."""
        tokens = 0
        now = time.time()
        for mb in micro_batches:
            for trie in mb.rows:
                for sample in trie.samples:
                    meta: _Meta = sample.meta
                    tokens += meta.num_tokens
                    self.metrics.append(("sample/staleness_mean", float(self.policy_version - meta.model_version), 1.0))
                    self.metrics.append(("sample/staleness_max", float(self.policy_version - meta.model_version), 1.0))
                    self.metrics.append(("sample/time_in_queue_s", now - meta.queued_at, 1.0))
                    left = self._pending.get(meta.row_index, 0) - 1
                    if left <= 0:
                        self._pending.pop(meta.row_index, None)
                        self._mark_consumed(meta.row_index)
                    else:
                        self._pending[meta.row_index] = left
        self.worker.report_step(tokens)
        return tokens

    def take_metrics(self) -> list[tuple[str, float, float]]:
        out, self.metrics = self.metrics, []
        return out

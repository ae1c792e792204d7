"""The trainer's side of the rollout queue: pull, drop stale, plan rows, count prompts (G4, P2, T3, T5, X3, X4).

Rank 0 owns it. Each step it pulls group results from the worker, drops samples
more than ``max_staleness`` weight updates behind (G4), feeds the token-budget
planner until ``gradient_accumulation_steps`` micro-batches are closed, and after
the optimizer step marks the trained prompts consumed, which moves the epoch
count (T3) and the first untrained prompt that checkpoints record (T5).

Staleness counts weight updates *the server received*: a sample stamped with the
step of the weights that generated it is ``t // k - stamp // k`` syncs behind at
step ``t`` when weights are pushed every ``k = weight_sync_steps`` steps. Counting
optimizer steps instead would drop every sample once ``k > max_staleness + 1``,
because the server has nothing newer to offer until the next sync.

Every prompt taken ends *settled* with an outcome (``trained``, ``zero_std``,
``rejected``, ``stale``, ``invalid``); checkpoints record the outcomes past the
first unsettled prompt, so a resume skips exactly what was settled (X3). A prompt
with some samples trained counts as trained. While a step waits for samples, a
line every 30 s says what is known (X4); groups that all tie stop the run after
``ZERO_STD_PATIENCE_GROUPS`` in a row, with that diagnosis. What a tied group leaves in
its step follows ``dynamic_sampling`` (``rollout/dynamic_sampling.py``): on, kept groups
fill the step, up to the over-sampling cap; off, the group's share of the budget stays
empty (``step_fill.py``).

Samples pulled but not trained by the step (held by the planner, which keeps a
group in one row, or still buffered) are accounted for exactly like samples still
in the worker's queue: their prompt stays unsettled (a checkpoint has the worker
generate it again), and while the step trains they count as queued tokens for the
worker's G3 allowance (released again when the next step starts pulling, so a step
never waits on tokens it holds itself). Without that, the worker would run ahead by
the held group, whose samples then land one update too late. A held group that would
be too stale by the next step is not postponed whole: the planner places what fits
now (``must_not_wait``), as it does without ``keep_groups``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from asyncgrpo.packing import MicroBatch, PackSample, TokenBudgetBatcher, plan_step
from asyncgrpo.packing.planner import CLOSE, GROUP_END, PullMark
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.worker import RolloutWorker
from asyncgrpo.trainer.data_accounting import DataAccounting
from asyncgrpo.trainer.no_signal import StepGroups, likely_cause, unanswering
from asyncgrpo.trainer.step_fill import is_share, strip_shares, tied_shares

logger = logging.getLogger(__name__)

READY_POLL_S = 0.001  # how long a step looks for a ready group before closing a micro-batch no group would fit
WAIT_LOG_INTERVAL_S = 30.0  # X4: a step that waits for samples says why at least this often
FIRST_NOTICE_S = 20.0  # a step still without a trainable group this long after it began says why (issue 30)
ZERO_STD_PATIENCE_GROUPS = 256  # this many scored groups in a row with equal rewards stop the run
OUTCOMES = ("trained", "zero_std", "rejected", "stale", "invalid")


class NoTrainableSamplesError(RuntimeError):
    """Every group the worker scored was dropped for equal rewards, past the patience bound (or to data's end)."""


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
        weight_sync_steps: optimizer steps between weight pushes (staleness counts pushes).
        settled: outcomes of prompts past ``start_index`` restored from a checkpoint; all but ``stale`` are skipped.
        zero_std_patience: consecutive all-tied groups after which the run stops (default ``ZERO_STD_PATIENCE_GROUPS``).
        server_urls: the run's generation servers, asked for ``/health`` when a step gets no trainable group (a
            dead server is named as the cause, not the reward).
        data: dynamic sampling's per-step counts and the settled prompt pools (``data_accounting.py``), or None.
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
        weight_sync_steps: int = 1,
        settled: dict[int, str] | None = None,
        zero_std_patience: int | None = None,
        server_urls: Sequence[str] = (),
        data: DataAccounting | None = None,
    ) -> None:
        self.worker = worker
        self.data = data
        self.batcher = batcher
        if batcher.keep_groups and batcher.must_not_wait is None:
            batcher.must_not_wait = self._stale_next_step
        self.ga = gradient_accumulation_steps
        self.max_staleness = max_staleness
        self.dataset_len = dataset_len
        self.total_prompts = total_prompts
        self.sample_timeout = sample_timeout
        self.weight_sync_steps = max(int(weight_sync_steps), 1)
        # Read at construction, not at import: a test run lowers the module's bound to reach it in a few groups.
        self.zero_std_patience = ZERO_STD_PATIENCE_GROUPS if zero_std_patience is None else zero_std_patience
        self.policy_version = 0
        self.first_untrained = start_index
        self._consumed: dict[int, str] = {}  # settled prompts past first_untrained -> outcome
        self._partial: set[int] = set()  # prompts with some samples trained and some pending
        for row, outcome in sorted((settled or {}).items()):
            if outcome != "stale":  # a prompt only dropped as stale is generated again
                self._mark_consumed(int(row), outcome)
        self._zero_std_streak = 0
        self._trained_any = False
        self.server_urls = tuple(server_urls)
        self._step_groups = self._step_zero_std = self._step_stale = 0
        self._step_seen = StepGroups()
        self._step_t0 = time.monotonic()
        self._next_notice = self._step_t0 + FIRST_NOTICE_S
        self._dropped_reward_sum = 0.0
        self._dropped_reward_n = 0
        self._pending: dict[int, int] = {}  # flat row index -> sequences not yet trained
        self._buffer: deque[PackSample] = deque()
        self._group_end_due = False  # the last sample pulled ended its group: the next pull says GROUP_END
        self._ended = False
        self._carried_tokens = 0  # tokens pulled but not trained by the last planned step (G3: still queued)
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

    def _mark_consumed(self, row_index: int, outcome: str = "trained") -> None:
        if row_index < self.first_untrained or row_index in self._consumed:
            return  # already counted
        self._partial.discard(row_index)
        self._consumed[row_index] = outcome
        if self.data is not None:
            self.data.on_settled(row_index, outcome)
        while self.first_untrained in self._consumed:
            del self._consumed[self.first_untrained]
            self.first_untrained += 1

    def is_settled(self, row_index: int) -> bool:
        return row_index < self.first_untrained or row_index in self._consumed

    def checkpoint_state(self) -> tuple[int, dict[int, str]]:
        """(first unsettled prompt, outcomes of the settled prompts past it); partly trained prompts count as trained.

        Read right after a step: what the checkpoint's weights trained is exactly what is settled here.
        """
        settled = dict(self._consumed)
        settled.update({row: "trained" for row in self._partial})
        return self.first_untrained, settled

    def pools_state(self) -> dict | None:
        """The settled prompt pools' state for a checkpoint (None when pools are off); read right after a step."""
        return self.data.pools_state(self._partial) if self.data is not None else None

    def _receive(self, timeout: float) -> None:
        """Pull one group result from the worker into the buffer (G4 stale drop happens here)."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            try:
                res: GroupResult = self.worker.get_sample(max(min(self._next_notice, deadline) - now, 0.01))
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    waited = time.perf_counter() - t0
                    raise TimeoutError(
                        f"{self._wait_status(waited, timeout)}; giving up (vllm_server_timeout)"
                    ) from None
                self._notice(timeout)
        self.wait_s += time.perf_counter() - t0
        self._notice(timeout)  # groups that keep arriving, all dropped, must not silence the line
        self._accept(res)

    def _receive_ready(self) -> bool:
        """Pull a group result only if one is ready now (within a millisecond); whether one was."""
        t0 = time.perf_counter()
        try:
            res: GroupResult = self.worker.get_sample(READY_POLL_S)
        except TimeoutError:
            return False
        finally:
            self.wait_s += time.perf_counter() - t0
        self._accept(res)
        return True

    def _accept(self, res: GroupResult) -> None:
        """One group result into the buffer, or settled (tied, rejected, invalid, stale; the end of data)."""
        if res.end:
            self._ended = True
            if not self._trained_any and self._step_zero_std and all(map(is_share, self._buffer)):
                raise NoTrainableSamplesError(self._zero_std_diagnosis("the data ended"))
            return
        # Pulled = no longer queued: the worker's token allowance (G3) frees now, not after the step, or a
        # step that needs more tokens than the allowance would wait forever for the worker.
        self.worker.report_consumed(res.tokens)
        self.worker.channels.count_queued(-len(res.sequences))
        if self.is_settled(res.row_index) or res.row_index in self._pending:
            return  # settled before a resume (or a duplicate): never trained twice
        self._step_groups += 1
        self._step_seen.add(res.dropped, res.rewards, res.tool_calls)
        if self.data is not None:
            self.data.on_pulled(res, self.policy_version + 1)
        if res.prompt_text is not None:
            self.completions_log.append(res)
        if res.dropped:
            self._zero_std_streak += 1
            self._step_zero_std += 1
            if res.rewards:
                self._dropped_reward_sum += sum(res.rewards)
                self._dropped_reward_n += len(res.rewards)
            self._mark_consumed(res.row_index, "zero_std")
            if self.data is not None and not self.data.dynamic:  # off: the group keeps its room in the step
                self._buffer.extend(tied_shares(res.row_index, res.group_id, res.row_tokens,
                                                self.batcher.token_budget, res.queued_at))  # fmt: skip
            if not self._trained_any and self.total_prompts is not None and self.prompts_consumed >= self.total_prompts:
                raise NoTrainableSamplesError(self._zero_std_diagnosis("the epochs ended without a trainable group"))
            if self._zero_std_streak >= self.zero_std_patience:
                raise NoTrainableSamplesError(
                    self._zero_std_diagnosis(f"{self._zero_std_streak} groups in a row tied (the bound)")
                )
            return
        if res.skipped or not res.sequences:
            self._mark_consumed(res.row_index, "rejected" if res.skipped else "invalid")
            return
        self._zero_std_streak = 0
        fresh = [s for s in res.sequences if not self._is_stale(s.model_version)]
        if len(fresh) < len(res.sequences):
            self._step_stale += len(res.sequences) - len(fresh)
            self.metrics.append(("sample/dropped_stale_count", float(len(res.sequences) - len(fresh)), 1.0))
        if not fresh:
            self._mark_consumed(res.row_index, "stale")
            return
        self._pending[res.row_index] = len(fresh)
        for s in fresh:
            meta = _Meta(res.row_index, s.model_version, res.queued_at, len(s.input_ids))
            self._buffer.append(PackSample.from_sequence(s, meta))

    def _zero_std_diagnosis(self, why: str) -> str:
        mean = self._dropped_reward_sum / max(self._dropped_reward_n, 1)
        cause = likely_cause(self._step_seen, unanswering(self.server_urls))
        return (
            f"step {self.policy_version + 1}: {self._step_groups} groups scored, {self._step_zero_std} dropped for "
            f"equal rewards (zero std; reward_dropped={mean:.2f}) and none trainable: {why}. Likely cause: "
            + (cause or "every completion of a prompt scores the same; check the reward functions")
        )

    def _notice(self, timeout: float) -> None:
        """Print the waiting line once its time has come (X4; the first one early when nothing is trainable)."""
        now = time.monotonic()
        if now < self._next_notice:
            return
        self._next_notice = now + WAIT_LOG_INTERVAL_S
        logger.warning("%s", self._wait_status(now - self._step_t0, timeout))

    def _wait_status(self, waited: float, timeout: float) -> str:
        """The X4 line of a step waiting for samples: what it waits for, for how long, and the likely cause."""
        status = (
            f"step {self.policy_version + 1}: waiting {waited:.0f}s for trainable samples from the rollout worker "
            f"(timeout {timeout:.0f}s per sample); since the step began {self._step_groups} groups were scored, "
            f"{self._step_zero_std} dropped for equal rewards, {self._step_stale} samples dropped as stale"
        )
        cause = likely_cause(self._step_seen, unanswering(self.server_urls))
        if cause:
            return f"{status}. Likely cause: {cause}"
        if not self._step_groups:
            status += " - generation is slow or stuck (the server's log and rollout/* metrics tell)"
        return status

    def behind(self, model_version: int) -> int:
        """Weight pushes between the weights stamped ``model_version`` and the current step's (see the module doc)."""
        k = self.weight_sync_steps
        return self.policy_version // k - model_version // k

    def _is_stale(self, model_version: int) -> bool:
        return self.behind(model_version) > self.max_staleness

    def _stale_next_step(self, samples: Sequence[PackSample]) -> bool:
        """The planner's ``must_not_wait``: some sample would be too stale if the group waited for the next step."""
        k = self.weight_sync_steps
        return any((self.policy_version + 1) // k - s.meta.model_version // k > self.max_staleness for s in samples)

    def _drop_stale(self, row_index: int, count: int) -> None:
        self.metrics.append(("sample/dropped_stale_count", float(count), 1.0))
        self._step_stale += count
        left = self._pending.get(row_index, 0) - count
        if left <= 0:
            self._pending.pop(row_index, None)
            self._mark_consumed(row_index, "trained" if row_index in self._partial else "stale")
        else:
            self._pending[row_index] = left

    def _pull(self) -> PackSample | PullMark | None:
        """The planner's next sample; ``GROUP_END`` after a group's last one (the buffer holds whole groups: a
        group result's samples arrive together); ``CLOSE`` when no group is ready and the open micro-batch could
        take none of the last groups: the step trains what it holds instead of waiting for a group it would most
        likely carry. A ready group is still pulled (it may fit after all, or be at its last fresh step:
        ``must_not_wait``), as every group was before, so only the wait goes."""
        if self._group_end_due:
            self._group_end_due = False
            return GROUP_END
        while True:
            while not self._buffer:
                if self._ended or (self.total_prompts is not None and self._requested_enough()):
                    return None
                if self.data is not None and self.data.cap_stops(self.policy_version + 1, self.batcher.pending_samples):
                    return None  # over the over-sampling cap: the step trains what it holds
                if not self.batcher.cannot_take_a_group():
                    self._receive(self.sample_timeout)
                elif not self._receive_ready():
                    return CLOSE
            sample = self._buffer.popleft()
            # Samples wait in the buffer across steps (a group larger than what a step still takes): check here.
            ends_group = not self._buffer or self._buffer[0].group_id != sample.group_id
            if not self._is_stale(sample.meta.model_version):
                self._group_end_due = ends_group
                return sample
            self._drop_stale(sample.meta.row_index, 1)
            if ends_group:  # the group's earlier samples may wait in the planner (a no-op if none do)
                return GROUP_END

    def _requested_enough(self) -> bool:
        # Everything needed to reach total_prompts is consumed or already placed in the planner.
        return self.prompts_consumed + len(self._pending) >= self.total_prompts

    def next_step(self, policy_version: int) -> list[MicroBatch]:
        """Micro-batches of the next step (fewer than ``gradient_accumulation_steps`` only at the end of data)."""
        self.policy_version = policy_version
        self.wait_s = 0.0
        self.worker.report_consumed(self._carried_tokens)  # being placed now: no longer held back from G3
        self._carried_tokens = 0
        self._step_groups = self._step_zero_std = self._step_stale = 0
        self._step_seen = StepGroups()
        self._step_t0 = time.monotonic()
        self._next_notice = self._step_t0 + FIRST_NOTICE_S
        self.metrics.append(("sample/dropped_stale_count", 0.0, 1.0))  # present (0) in every window
        # The sample that closed the last step waits in the planner; re-check it (and any others) against the
        # new version so no sample is trained more than max_staleness updates behind (G4).
        self._group_end_due = False  # the planner's samples go back to the buffer and are pulled again
        for sample in reversed(self.batcher.take_open_samples()):
            if self._is_stale(sample.meta.model_version):
                self._drop_stale(sample.meta.row_index, 1)
            else:
                self._buffer.appendleft(sample)
        self.metrics.append(("rollout/queue_size", float(self.worker.queue_size()), 1.0))
        self.worker.set_trainer_waiting(True)  # a sync_rollouts worker generates only while this is open
        try:
            while True:
                micro = plan_step(self.batcher, self._pull, self.ga)
                if self.data is None or self.data.dynamic:
                    return micro
                # Off: tied groups' shares filled part of the budget; a step of nothing but shares keeps pulling.
                kept = strip_shares(micro, self.batcher.share_prefixes)
                if kept or len(micro) < self.ga:
                    return kept
        finally:
            self.worker.set_trainer_waiting(False)
            # Pulled but left for a later step: queued again as far as the worker's allowance (G3) goes.
            self._carried_tokens = sum(s.meta.num_tokens for s in self.carried_samples())
            self.worker.report_consumed(-self._carried_tokens)
            if self.data is not None:
                self.metrics += self.data.plan_metrics()

    def carried_samples(self) -> list[PackSample]:
        """Pulled from the worker but in no micro-batch returned yet: held by the planner, or buffered."""
        return [*self.batcher.held_samples(), *self._buffer]

    def step_done(self, micro_batches: list[MicroBatch]) -> int:
        """Account for a finished optimizer step; returns the flat tokens it trained (G3's per-step report)."""
        tokens = 0
        now = time.time()
        for mb in micro_batches:
            for trie in mb.rows:
                for sample in trie.samples:
                    meta: _Meta = sample.meta
                    tokens += meta.num_tokens
                    self.metrics.append(("sample/forwarded_tokens_mean", float(meta.num_tokens), 1.0))
                    self.metrics.append(("sample/forwarded_tokens_max", float(meta.num_tokens), 1.0))
                    self.metrics.append(("sample/trained_tokens_mean", float(sample.num_trained), 1.0))
                    behind = float(self.behind(meta.model_version))
                    self.metrics.append(("sample/staleness_mean", behind, 1.0))
                    self.metrics.append(("sample/staleness_max", behind, 1.0))
                    self.metrics.append(("sample/time_in_queue_s", now - meta.queued_at, 1.0))
                    self._trained_any = True
                    left = self._pending.get(meta.row_index, 0) - 1
                    if left <= 0:
                        self._pending.pop(meta.row_index, None)
                        self._mark_consumed(meta.row_index, "trained")
                    else:
                        self._pending[meta.row_index] = left
                        self._partial.add(meta.row_index)
        if self.data is not None:
            self.metrics += self.data.pools_metrics()  # after the step's settles: what its checkpoint saves
        self.worker.report_step(tokens)
        return tokens

    def take_metrics(self) -> list[tuple[str, float, float]]:
        out, self.metrics = self.metrics, []
        return out

"""The group producer: groups kept in flight under the staleness admission (G3), failures, the end of data.

``GroupProducer.run`` takes prompts from a ``PromptSource`` (``prompt_order.py``), asks ``accept`` (the loop's
``filter_prompt``) about each, and starts a group task only while the token-based staleness admission allows; a
group task is ``run_group`` (``group_run.py``: its rollouts under the concurrency cap G5, scoring, queueing),
which returns what the admission must learn. The first failing group stops the run; when the data runs out the
producer waits for the last groups and queues the end-of-data marker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from asyncgrpo.rollout.admission import StalenessAdmission
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompt_order import PromptItem, PromptSource

ADMISSION_POLL_S = 0.01  # how often a waiting group start re-reads the trainer's counters
END_POLL_S = 0.05  # how often the wait for the last groups re-reads the trainer's stop event


@dataclass(frozen=True)
class GroupOutcome:
    """What a finished group tells the admission: the tokens it generated in all and those that went to the queue;
    and its total rewards, which a prompt source that learns from them (prompt pools) is told."""

    tokens: int
    kept_tokens: int
    rewards: tuple[float, ...] | None = None


class GroupProducer:
    """Starts groups for the prompts of ``source`` and keeps them in flight until the data runs out or the trainer
    stops the run.

    Args:
        source: the prompts, in training order.
        channels: the worker's channels (``stop``, ``samples``, the trainer's token counters, ``put_metric``).
        admission: the staleness admission (G3); the producer tells it of every group started and finished.
        accept: whether to generate for a prompt (rejected prompts are queued as consumed for the epoch).
        run_group: one group, from its prompt to its queued result; ``(prompt, group_id)``.
        sync_rollouts: start groups only while the trainer waits for a step's samples.
    """

    def __init__(
        self,
        source: PromptSource,
        channels: Any,
        admission: StalenessAdmission,
        *,
        accept: Callable[[PromptItem], bool],
        run_group: Callable[[PromptItem, int], Awaitable[GroupOutcome]],
        sync_rollouts: bool = False,
    ) -> None:
        self.source = source
        self.channels = channels
        self.admission = admission
        self.accept = accept
        self.run_group = run_group
        self.sync_rollouts = sync_rollouts
        self.tasks: set[asyncio.Task] = set()
        self.failure: BaseException | None = None  # the first exception of a group task
        self.group_finished = asyncio.Event()  # wakes a group start that waits on the staleness admission

    async def run(self) -> None:
        """Returns when the data ran out (the end-of-data marker queued) or ``channels.stop`` is set."""
        stop = self.channels.stop
        group_id = 0
        epoch, accepted, rejected = None, 0, 0
        for item in self.source:
            if stop.is_set():
                break
            if item is None:  # the source's next prompt depends on a group still in flight
                await self._wait_for_a_group()
                continue
            if item.epoch != epoch:
                self._check_epoch(epoch, accepted, rejected)
                epoch, accepted, rejected = item.epoch, 0, 0
            if not self.accept(item):
                self.channels.samples.put(GroupResult.rejected(item.flat_index, item.epoch, item.row_index))
                rejected += 1
                continue
            accepted += 1
            await self._wait_for_admission()
            if stop.is_set():
                break
            self.admission.on_group_started()
            task = asyncio.create_task(self._group(item, group_id))
            self.tasks.add(task)
            task.add_done_callback(self._on_group_done)
            group_id += 1
            await self._raise_failed()
        else:
            self._check_epoch(epoch, accepted, rejected)
        await self._finish()

    def _check_epoch(self, epoch: int | None, accepted: int, rejected: int) -> None:
        if (
            epoch is not None
            and accepted == 0
            and rejected == self.source.epoch_len
            and not self.channels.stop.is_set()
        ):
            raise ValueError(f"filter_prompt rejected every prompt of epoch {epoch}; no batch can reach the trainer")

    async def _group(self, item: PromptItem, group_id: int) -> None:
        outcome = await self.run_group(item, group_id)
        self.admission.on_group_finished(outcome.tokens, outcome.kept_tokens)
        self.group_finished.set()

    async def _finish(self) -> None:
        """The last groups, then the end-of-data marker (or, once the trainer stopped, a quiet cancel)."""
        # Woken as each group ends (a fixed sleep here held the end-of-data marker up to 50 ms after the last
        # sample); the timeout only re-reads the trainer's stop event, which has no awaitable.
        while not self.channels.stop.is_set():
            await self._raise_failed()
            pending = {t for t in self.tasks if not t.done()}
            if not pending:
                break
            await asyncio.wait(pending, timeout=END_POLL_S, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0)  # the done-callbacks of groups that just ended record their failures first
        await self._raise_failed()
        if self.channels.stop.is_set():  # the trainer is done: drop in-flight rollouts quietly
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            return
        self.channels.samples.put(GroupResult.end_of_data())

    async def _wait_for_a_group(self) -> None:
        """Until a group finishes (or the run stops or fails); each group ends within its requests' timeouts."""
        t0 = time.perf_counter()
        self.group_finished.clear()  # no await since the source said no: a group finishing now still wakes us
        while not self.group_finished.is_set() and not self.channels.stop.is_set():
            await self._raise_failed()
            if not self.tasks:
                raise RuntimeError("the prompt source waits for a group but none is in flight (a source bug)")
            try:
                await asyncio.wait_for(self.group_finished.wait(), END_POLL_S)
            except TimeoutError:
                pass
        self.channels.put_metric("pools/draw_wait_s", time.perf_counter() - t0)

    def _trainer_wants_samples(self) -> bool:
        """Always, unless ``sync_rollouts``: then only while the trainer waits for a step's samples."""
        gate = getattr(self.channels, "trainer_waiting", None)
        return not self.sync_rollouts or gate is None or gate.is_set()

    async def _wait_for_admission(self) -> None:
        t0 = time.perf_counter()
        while True:
            await self._raise_failed()  # a failed group must stop the run even while generation waits
            self.admission.on_trainer_report(self.channels.tokens_consumed.value, self.channels.tokens_per_step.value)
            if self.channels.stop.is_set():
                break
            if self.admission.can_start_group() and self._trainer_wants_samples():
                break
            # Woken at once when a group finishes (the first one unblocks G3's one-at-a-time start); the trainer's
            # counters are shared memory without a signal, so they are polled every 10 ms.
            self.group_finished.clear()
            try:
                await asyncio.wait_for(self.group_finished.wait(), ADMISSION_POLL_S)
            except TimeoutError:
                pass
        self.channels.put_metric("rollout/backpressure_s", time.perf_counter() - t0)

    async def _raise_failed(self) -> None:
        if self.failure is not None:
            for other in self.tasks:
                other.cancel()
            raise self.failure

    def _on_group_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self.failure is None:
            self.failure = task.exception()

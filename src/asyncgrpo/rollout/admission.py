"""When the rollout worker may start another group (G3) and how many rollouts may run (G5, G6).

Two independent limits gate generation:

* **Staleness, in tokens** (G3). The number of samples a step uses varies with
  completion length, so the worker bounds *tokens*: after each optimizer step the
  trainer reports the tokens that step used, and the worker keeps at most
  ``max(max_staleness, 1) ×`` that many tokens queued or in flight. A group
  starts only if it keeps the total within the limit (its size estimated from the
  groups so far), or when nothing is outstanding at all (a group larger than the
  whole allowance still runs, alone); starting whenever the total is below the
  limit would put one group past it, and at the queue's tail that group lands a
  weight update too late (G4 drops it, whole when the planner keeps groups
  together). Before the first step every row of a step is assumed full
  (``token_budget × rows``). Until the first group completes nobody knows how long
  a rollout is, so groups start one at a time.
* **Server load** (G5). A live cap on concurrent rollouts follows the server's
  KV-cache usage, polled from its Prometheus ``/metrics``; without ``/metrics``
  the cap is ``max_concurrent_rollouts`` (G6), which also bounds it from above.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from dataclasses import dataclass

# G5 constants, from the reference (docs/spec.md).
METRICS_POLL_INTERVAL_S = 5.0  # how often the worker reads the server's /metrics
KV_USAGE_LOW = 0.60  # below this (and nothing queued on the server) the cap may grow
KV_USAGE_HIGH = 0.80  # above this the cap shrinks
CAP_GROWTH = 0.25  # at most +25 % per raise, one raise per `cap` completed rollouts
CAP_SHRINK = 0.30  # -30 % when the KV cache is over KV_USAGE_HIGH


@dataclass
class StalenessAdmission:
    """Token accounting behind G3; owned by the worker, fed by the trainer's reports.

    The worker tells it what it does (``on_group_started``, ``on_group_finished``) and passes on
    the trainer's two shared counters with ``on_trainer_report``; it counts everything else itself.

    Args:
        max_staleness: the config's ``max_staleness`` (0 allows one step of look-ahead tokens).
        initial_tokens_per_step: the first step's assumption, ``token_budget × rows per step``.
    """

    max_staleness: int
    initial_tokens_per_step: int
    tokens_per_step: int | None = None  # last value reported by the trainer
    enqueued_tokens: int = 0  # tokens of every sample put on the queue so far
    consumed_tokens: int = 0  # tokens of every sample the trainer pulled so far (its report)
    inflight_groups: int = 0
    completed_groups: int = 0
    completed_group_tokens: int = 0  # sum over completed groups, for the per-group estimate

    def __post_init__(self) -> None:
        if self.initial_tokens_per_step <= 0:
            raise ValueError(f"initial_tokens_per_step must be > 0, got {self.initial_tokens_per_step}")

    @property
    def limit(self) -> int:
        """Tokens allowed queued or in flight."""
        per_step = self.tokens_per_step if self.tokens_per_step is not None else self.initial_tokens_per_step
        return max(self.max_staleness, 1) * per_step

    @property
    def queued_tokens(self) -> int:
        """Scored tokens waiting in the queue (put there, not yet pulled by the trainer)."""
        return max(0, self.enqueued_tokens - self.consumed_tokens)

    @property
    def tokens_per_group_estimate(self) -> float | None:
        if self.completed_groups == 0:
            return None
        return self.completed_group_tokens / self.completed_groups

    @property
    def outstanding_tokens(self) -> float:
        """Queued tokens plus the estimated size of groups still generating."""
        est = self.tokens_per_group_estimate or 0.0
        return self.queued_tokens + self.inflight_groups * est

    def can_start_group(self) -> bool:
        if self.completed_groups == 0:
            return self.inflight_groups == 0  # unknown rollout length: one group at a time
        outstanding = self.outstanding_tokens
        return outstanding == 0 or outstanding + (self.tokens_per_group_estimate or 0.0) <= self.limit

    def on_group_started(self) -> None:
        self.inflight_groups += 1

    def on_group_finished(self, tokens: int, kept_tokens: int) -> None:
        """A group completed: ``tokens`` it generated in all, ``kept_tokens`` that went to the queue."""
        if self.inflight_groups <= 0:
            raise RuntimeError("on_group_finished without a started group: call on_group_started first")
        self.inflight_groups -= 1
        self.completed_groups += 1
        self.completed_group_tokens += tokens
        self.enqueued_tokens += kept_tokens

    def on_trainer_report(self, consumed_tokens: int, tokens_per_step: int) -> None:
        """The trainer's counters: total tokens it pulled from the queue, tokens its last step used (0: none yet)."""
        self.consumed_tokens = int(consumed_tokens)
        if tokens_per_step > 0:
            self.tokens_per_step = int(tokens_per_step)


class ConcurrencyCap:
    """G5: a live cap on concurrent rollouts that follows the server's KV-cache usage.

    Args:
        max_concurrent_rollouts: the hard bound (G6).
        kv_cache_tokens: the server's KV capacity in tokens, or None when unknown.
        max_model_len: the server's maximum sequence length.
        has_metrics: whether the server answers ``/metrics``; without it the cap is the hard bound.
    """

    def __init__(
        self, max_concurrent_rollouts: int, kv_cache_tokens: int | None, max_model_len: int, has_metrics: bool
    ) -> None:
        if max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {max_concurrent_rollouts}")
        self.max_concurrent = max_concurrent_rollouts
        self.adaptive = has_metrics and kv_cache_tokens is not None
        if self.adaptive:
            self.cap = max(1, min(max_concurrent_rollouts, kv_cache_tokens // max(max_model_len, 1)))
        else:
            self.cap = max_concurrent_rollouts
        self._completed_since_raise = 0

    def on_rollout_completed(self) -> None:
        self._completed_since_raise += 1

    def on_metrics(self, kv_cache_usage: float, num_waiting: int) -> int:
        """Apply one ``/metrics`` reading (usage 0..1, the server's waiting requests); returns the new cap."""
        if not self.adaptive:
            return self.cap
        if kv_cache_usage > KV_USAGE_HIGH:
            self.cap = max(1, math.floor(self.cap * (1.0 - CAP_SHRINK)))
            self._completed_since_raise = 0
        elif kv_cache_usage < KV_USAGE_LOW and num_waiting == 0 and self._completed_since_raise >= self.cap:
            self.cap = min(self.max_concurrent, max(self.cap + 1, math.floor(self.cap * (1.0 + CAP_GROWTH))))
            self._completed_since_raise = 0
        return self.cap


class RolloutSlots:
    """The running rollouts under the live cap (G5): a rollout takes a slot before its first request and frees it
    when it ends; a group sent as one request takes its G slots at once.

    Args:
        cap: the live cap (its ``cap`` moves with the server's KV use).
        put_metric: sink for ``rollout/concurrency``.
    """

    def __init__(self, cap: ConcurrencyCap, put_metric: Callable[[str, float], None]) -> None:
        self.cap = cap
        self.put_metric = put_metric
        self.running = 0
        self.freed = asyncio.Condition()

    async def acquire(self, count: int = 1) -> None:
        """Take ``count`` slots at once: taking them one by one, two groups could each hold part of what both
        need. More than the cap starts only when nothing runs."""
        async with self.freed:
            while self.running and self.running + count > self.cap.cap:
                try:
                    await self.freed.wait()
                except asyncio.CancelledError:  # pass on a wake-up this waiter may have taken (it holds the lock)
                    if self.running < self.cap.cap:
                        self.freed.notify(1)
                    raise
            self.running += count
            if self.running < self.cap.cap:  # room left (the cap grew): pass the wake-up on to the next one
                self.freed.notify(1)
        self.put_metric("rollout/concurrency", self.running)

    async def release(self, count: int = 1) -> None:
        async with self.freed:
            self.running -= count
            for _ in range(count):
                self.cap.on_rollout_completed()
            # As many waiters woken as slots freed (each wakes the next if room is left): notify_all would wake
            # every queued rollout on each completion, work that grows with concurrency.
            self.freed.notify(count)

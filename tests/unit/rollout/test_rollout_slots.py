"""The rollout loop's concurrency slots (G5): a completion wakes as many queued rollouts as there are free slots.

Waking every queued rollout on each completion (notify_all) costs work proportional to the queue on every
completion, which grows with concurrency; the count of wake-ups here is the reference.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.rollout.admission import ConcurrencyCap, RolloutSlots


def _slots(cap: int) -> RolloutSlots:
    """The loop's slots (what run() sets up before any rollout starts)."""
    return RolloutSlots(ConcurrencyCap(cap, kv_cache_tokens=None, max_model_len=1, has_metrics=False),
                        lambda name, value: None)  # fmt: skip


def test_each_completion_wakes_only_the_rollouts_it_frees_a_slot_for():
    async def main() -> tuple[int, int]:
        slots = _slots(cap=8)
        wakeups, peak = 0, 0
        inner = slots.freed.wait

        async def counted_wait() -> bool:
            nonlocal wakeups
            result = await inner()
            wakeups += 1
            return result

        slots.freed.wait = counted_wait  # type: ignore[method-assign]

        async def rollout() -> None:
            nonlocal peak
            await slots.acquire()
            peak = max(peak, slots.running)
            await asyncio.sleep(0)
            await slots.release()

        await asyncio.wait_for(asyncio.gather(*(rollout() for _ in range(400))), timeout=30)
        return wakeups, peak

    wakeups, peak = asyncio.run(main())
    assert peak == 8  # the cap holds
    # 392 rollouts had to queue; about one wake-up each is needed (notify_all on every completion: 9,800 here)
    assert wakeups <= 2 * 400, f"{wakeups} wake-ups for 400 rollouts"


def test_a_cancelled_waiter_passes_its_wake_up_on():
    """The rollout woken for a freed slot is cancelled before it runs: the next queued one gets the slot."""

    async def main() -> None:
        slots = _slots(cap=1)
        await slots.acquire()  # the one running rollout
        first = asyncio.create_task(slots.acquire())
        second = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0.01)  # both queued
        await slots.release()  # wakes `first` only
        first.cancel()
        await asyncio.wait_for(second, timeout=5)  # would hang if the wake-up died with `first`
        assert slots.running == 1

    asyncio.run(main())


@pytest.mark.parametrize(("cap", "group", "most"), [(10, 4, 8), (10, 8, 8), (5, 8, 8), (16, 8, 16)])
def test_groups_take_their_slots_at_once_and_never_deadlock(cap, group, most):
    """A group sent as one request takes its G slots together: the cap holds (a group larger than the cap runs
    alone), and groups that each took part of what they need can never block one another."""

    async def main() -> int:
        slots = _slots(cap=cap)
        peak = 0

        async def one_group() -> None:
            nonlocal peak
            await slots.acquire(group)
            peak = max(peak, slots.running)
            await asyncio.sleep(0)
            await slots.release(group)

        await asyncio.wait_for(asyncio.gather(*(one_group() for _ in range(60))), timeout=30)
        assert slots.running == 0
        return peak

    assert asyncio.run(main()) == most  # whole groups up to the cap (or one group alone when it exceeds the cap)

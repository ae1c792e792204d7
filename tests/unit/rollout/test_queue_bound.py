"""queue_maxsize: a scored group waits while its samples would overfill the sample queue (real shared counters)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp

from asyncgrpo.rollout.queue_bound import wait_for_queue_room
from asyncgrpo.rollout.worker import WorkerChannels


def _channels() -> WorkerChannels:
    ctx = mp.get_context("spawn")
    return WorkerChannels(samples=None, metrics=None, errors=None, stop=ctx.Event(), policy_version=ctx.Value("q", 0),
                          tokens_per_step=ctx.Value("q", 0), tokens_consumed=ctx.Value("q", 0),
                          heartbeat=ctx.Value("d", 0.0), samples_queued=ctx.Value("q", 0))  # fmt: skip


def test_a_group_waits_until_the_trainer_pulls_enough():
    ch = _channels()
    ch.count_queued(6)  # 6 samples waiting

    async def scenario() -> tuple[bool, float]:
        waiter = asyncio.create_task(wait_for_queue_room(ch, 4, 8))  # 6 + 4 > 8: must wait
        await asyncio.sleep(0.3)
        held = not waiter.done()
        ch.count_queued(-2)  # the trainer pulled a group of 2: 4 + 4 <= 8
        return held, await asyncio.wait_for(waiter, 2.0)

    held, waited = asyncio.run(scenario())
    assert held and waited >= 0.3


def test_no_wait_under_the_bound_on_an_empty_queue_or_without_a_bound():
    ch = _channels()
    ch.count_queued(4)
    assert asyncio.run(wait_for_queue_room(ch, 4, 8)) == 0.0  # 4 + 4 fits exactly
    assert asyncio.run(wait_for_queue_room(ch, 50, 0)) == 0.0  # 0: no bound
    ch.count_queued(-4)
    assert asyncio.run(wait_for_queue_room(ch, 50, 8)) == 0.0  # a group larger than the bound, alone, goes through


def test_a_stop_releases_a_waiting_group():
    ch = _channels()
    ch.count_queued(8)

    async def scenario() -> float:
        waiter = asyncio.create_task(wait_for_queue_room(ch, 1, 8))
        await asyncio.sleep(0.1)
        ch.stop.set()
        return await asyncio.wait_for(waiter, 2.0)

    assert asyncio.run(scenario()) >= 0.1

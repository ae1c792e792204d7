"""The group producer on its own (``rollout/production.py``): prompts from a ``PromptSource``, rejected prompts,
the staleness admission's accounting, the end of data, and a prompt source of another kind plugged in.

The groups here are coroutines that return a made-up ``GroupOutcome``; the expected markers, group ids and token
totals are worked out from the dataset and the filter in each test.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from asyncgrpo.rollout.admission import StalenessAdmission
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.production import GroupOutcome, GroupProducer
from asyncgrpo.rollout.prompt_order import PromptItem, PromptOrder, PromptSource


class _Samples:
    def __init__(self) -> None:
        self.items: list[GroupResult] = []

    def put(self, item: GroupResult) -> None:
        self.items.append(item)


def _channels() -> SimpleNamespace:
    return SimpleNamespace(samples=_Samples(), stop=threading.Event(), tokens_consumed=SimpleNamespace(value=0),
                           tokens_per_step=SimpleNamespace(value=0), put_metric=lambda *a: None)  # fmt: skip


def _produce(source: PromptSource, accept, tokens_of=lambda item: 10) -> tuple[GroupProducer, list[tuple[int, int]]]:
    """Run a producer whose groups queue a sample for their prompt; returns it and the (group_id, flat) started."""
    started: list[tuple[int, int]] = []
    channels = _channels()

    async def run_group(item: PromptItem, group_id: int) -> GroupOutcome:
        started.append((group_id, item.flat_index))
        await asyncio.sleep(0)
        channels.samples.put(GroupResult(row_index=item.flat_index, epoch=item.epoch, group_id=group_id))
        return GroupOutcome(tokens=tokens_of(item), kept_tokens=tokens_of(item) // 2)

    producer = GroupProducer(source, channels, StalenessAdmission(1000, 10**9), accept=accept, run_group=run_group)
    asyncio.run(asyncio.wait_for(producer.run(), timeout=20))
    return producer, started


class _Rows:
    """An iterable dataset without ``len`` (like an ``IterableDataset``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict]:
        return iter({"prompt": i} for i in range(self.n))


@pytest.mark.parametrize("dataset", [[{"prompt": i} for i in range(3)], _Rows(3)], ids=["sized", "iterable"])
def test_an_epoch_whose_every_prompt_is_rejected_fails_after_its_last_prompt(dataset):
    with pytest.raises(ValueError, match="rejected every prompt of epoch 0"):
        _produce(PromptOrder(dataset, 0, num_epochs=None), accept=lambda item: False)


def test_rejected_prompts_groups_and_the_admission_over_two_epochs():
    dataset = [{"prompt": i} for i in range(4)]
    producer, started = _produce(PromptOrder(dataset, 0, num_epochs=2), accept=lambda item: item.flat_index % 3 != 0,
                                 tokens_of=lambda item: 10 + item.flat_index)  # fmt: skip
    # flat indices 0..7; 0, 3 and 6 rejected: five groups, numbered in the order they started
    assert started == [(0, 1), (1, 2), (2, 4), (3, 5), (4, 7)]
    items = producer.channels.samples.items
    assert sorted(it.row_index for it in items if it.skipped) == [0, 3, 6]
    assert sorted(it.row_index for it in items if not it.skipped and not it.end) == [1, 2, 4, 5, 7]
    assert items[-1].end and sum(it.end for it in items) == 1
    adm = producer.admission
    assert (adm.inflight_groups, adm.completed_groups) == (0, 5)
    assert adm.completed_group_tokens == sum(10 + f for f in (1, 2, 4, 5, 7))  # 69
    assert adm.enqueued_tokens == sum((10 + f) // 2 for f in (1, 2, 4, 5, 7))  # 5 + 6 + 7 + 7 + 8 = 33


class _Pool:
    """A prompt source of another kind: a fixed list of prompts, each under a flat index of its own, no epochs."""

    epoch_len = None

    def __init__(self, flats: list[int]) -> None:
        self.flats = flats

    def __iter__(self) -> Iterator[PromptItem]:
        return iter(PromptItem(0, f % 10, f, {"prompt": f}) for f in self.flats)


def test_another_prompt_source_plugs_in():
    producer, started = _produce(_Pool([42, 17, 99]), accept=lambda item: True)
    assert started == [(0, 42), (1, 17), (2, 99)]
    assert [it.row_index for it in producer.channels.samples.items if not it.end] == [42, 17, 99]


def test_a_failing_group_stops_the_run_with_its_error():
    channels = _channels()

    async def run_group(item: PromptItem, group_id: int) -> GroupOutcome:
        raise RuntimeError(f"group {group_id} failed")

    producer = GroupProducer(PromptOrder([{"prompt": 0}, {"prompt": 1}], 0, 1), channels,
                             StalenessAdmission(1000, 10**9), accept=lambda item: True, run_group=run_group)  # fmt: skip
    with pytest.raises(RuntimeError, match="group 0 failed"):
        asyncio.run(asyncio.wait_for(producer.run(), timeout=20))
    assert not any(it.end for it in channels.samples.items)


def test_prompt_pools_draw_the_same_rows_whatever_order_groups_finish_in():
    """A pools source yields None while its next draw needs a group in flight; the producer waits for one. Two runs
    whose groups finish in opposite orders draw the same rows, with never more than lag + 1 groups in flight."""
    from asyncgrpo.rollout.pool_source import PoolPromptSource
    from asyncgrpo.rollout.prompt_pools import PoolSettings

    settings = PoolSettings(thresholds=(0.5,), weights=(1.0, 2.0, 1.0), min_groups=1, requeue_delay=2, lag=2)
    dataset = [{"prompt": i} for i in range(6)]

    def run(delay) -> tuple[list[tuple[int, int]], int]:
        source = PoolPromptSource(dataset, settings, num_epochs=4)
        channels, drawn, live, peak = _channels(), [], set(), [0]

        async def run_group(item: PromptItem, group_id: int) -> GroupOutcome:
            drawn.append((item.flat_index, item.row_index))
            live.add(item.flat_index)
            peak[0] = max(peak[0], len(live))
            await asyncio.sleep(delay(item.flat_index))
            live.discard(item.flat_index)
            source.on_group(item.flat_index, [1.0, 0.0] if item.row_index % 2 else [0.0, 0.0])
            return GroupOutcome(tokens=1, kept_tokens=1)

        producer = GroupProducer(source, channels, StalenessAdmission(1000, 10**9), accept=lambda item: True,
                                 run_group=run_group)  # fmt: skip
        asyncio.run(asyncio.wait_for(producer.run(), timeout=20))
        return drawn, peak[0]

    early_first, peak_a = run(lambda flat: 0.001 * (1 + flat % 3))
    late_first, peak_b = run(lambda flat: 0.001 * (3 - flat % 3))
    assert early_first == late_first and [f for f, _ in early_first] == list(range(24))
    assert max(peak_a, peak_b) <= settings.lag + 1

"""The pools as the worker's prompt source: flat indices as the trainer settles them, feedback, the end of data."""

from __future__ import annotations

import pytest

from asyncgrpo.rollout.pool_source import PoolPromptSource
from asyncgrpo.rollout.prompt_pools import PoolSettings

NEW_FIRST = PoolSettings(
    thresholds=(0.5,), weights=(1.0, 0.0, 0.0), retire_at=1.0, min_groups=1, requeue_delay=0, lag=0
)
ROWS = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(4)]


def test_draws_take_flat_indices_past_the_settled_ones_and_stop_at_the_epochs():
    # Resumed at flat index 5 with 6 and 8 settled: the draws get 5, 7, 9, 10, 11 (then the 3 epochs of 4 end).
    source = PoolPromptSource(ROWS, NEW_FIRST, start_index=5, num_epochs=3, skip=frozenset({6, 8}))
    items = []
    for item in source:
        items.append(item)
        source.on_group(item.flat_index, [0.0, 1.0])  # half pass: never retired
    assert [i.flat_index for i in items] == [5, 7, 9, 10, 11]
    assert [i.epoch for i in items] == [1, 1, 2, 2, 2]  # flat // len(dataset)
    assert all(i.row == ROWS[i.row_index] for i in items)
    assert sorted(i.row_index for i in items[:4]) == [0, 1, 2, 3]  # the new pool empties first


def test_the_source_ends_when_every_prompt_is_retired():
    source = PoolPromptSource(ROWS[:2], NEW_FIRST, pass_threshold=0.5)
    drawn = []
    for item in source:  # no epoch bound: the retirements end it
        drawn.append(item.row_index)
        source.on_group(item.flat_index, [0.5, 0.9])  # every sample passes at 0.5: retired after one group
    assert sorted(drawn) == [0, 1] and source.pools.exhausted


def test_a_rejected_or_unscored_group_teaches_nothing():
    source = PoolPromptSource(ROWS[:1], NEW_FIRST, num_epochs=3)
    it = iter(source)
    first = next(it)
    source.on_group(first.flat_index, None)  # filter_prompt said no: a result that teaches nothing
    assert source.pools.results == {0: (0, None)} and source.pools.rate == {}
    second = next(it)
    assert (second.row_index, second.flat_index) == (0, 1)


def test_a_draw_that_needs_a_group_in_flight_yields_none_until_it_returns():
    settings = PoolSettings(thresholds=(0.5,), weights=(1.0, 1.0, 1.0), lag=1)
    source = PoolPromptSource(ROWS, settings)
    it = iter(source)
    a, b = next(it), next(it)  # draws 0 and 1 see nothing yet (lag 1)
    assert next(it) is None  # draw 2 must learn draw 0's result first: the producer waits for a group
    source.on_group(b.flat_index, [1.0, 0.0])
    assert next(it) is None  # draw 1 returned first: draw 0 is still out
    source.on_group(a.flat_index, [1.0, 1.0])
    c = next(it)
    assert c.flat_index == 2 and source.pools.rate == {a.row_index: 1.0}  # draw 1 waits for draw 3


def test_an_iterable_dataset_is_refused():
    with pytest.raises(ValueError, match="map-style"):
        PoolPromptSource(iter(ROWS), NEW_FIRST)

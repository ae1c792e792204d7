"""The trainer's copy of the pools counts a group once its prompt settles; dynamic sampling's per-step counts."""

from __future__ import annotations

import logging

import pytest

from asyncgrpo.rollout.dynamic_sampling import OverSamplingCount
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompt_pools import PoolSettings, PromptPools
from asyncgrpo.trainer.data_accounting import DataAccounting

SETTINGS = PoolSettings(thresholds=(0.5,), weights=(1.0, 1.0, 1.0), min_groups=1, requeue_delay=2, lag=1)


def group(flat: int, row: int, rewards: list[float], dropped: bool = False) -> GroupResult:
    return GroupResult(row_index=flat, epoch=0, dataset_row=row, rewards=rewards, dropped=dropped)


def test_pools_learn_settled_groups_in_draw_order():
    data = DataAccounting(None, PromptPools(3, SETTINGS), pass_threshold=1.0)
    data.on_pulled(group(0, 2, [1.0, 0.0, 1.0, 1.0]), step=1)  # 3 of 4 pass
    data.on_pulled(group(1, 0, [1.0, 1.0, 1.0, 1.0], dropped=True), step=1)  # all tied at 1: solved
    data.on_pulled(group(2, 1, [0.0, 0.0, 1.0, 0.0]), step=1)
    data.on_pulled(GroupResult.rejected(3, 1, dataset_row=1), step=1)  # filter_prompt said no
    assert data.pools.results == {}  # pulled, none settled yet: a checkpoint now saves none of them
    data.on_settled(1, "zero_std")
    assert data.pools.results == {1: (0, 1.0)} and data.pools.applied == 0  # draw 0 is not settled: it waits
    data.on_settled(0, "trained")
    # Draws 0 and 1 settled: a worker about to make draw 2 has learnt draw 0 (lag 1), so the copy applies it.
    assert data.pools.applied == 1 and data.pools.rate == {2: 0.75}
    data.on_settled(2, "stale")  # the worker learnt it too (stale is the trainer's verdict)
    data.on_settled(3, "rejected")
    assert data.pools.applied == 3 and data.pools.rate == {2: 0.75, 0: 1.0, 1: 0.25}
    assert data.pools.retired == {0}  # rate 1.0 after min_groups=1
    assert data.pools.results == {3: (1, None)}  # applied at the next draw: nothing learnt from a rejection
    state = data.pools_state()
    assert state["retired"] == [0] and state["applied"] == 3 and state["results"] == {"3": [1, None]}
    m = {name: value for name, value, _ in data.pools_metrics()}
    assert (m["pools/hard/size"], m["pools/easy/size"], m["pools/retired"]) == (1.0, 1.0, 1.0)


def test_a_checkpoint_counts_partly_trained_prompts_as_settled():
    data = DataAccounting(None, PromptPools(3, SETTINGS), pass_threshold=1.0)
    data.on_pulled(group(0, 1, [1.0, 0.0]), step=1)
    data.on_pulled(group(1, 2, [1.0, 1.0]), step=1)
    data.on_settled(1, "trained")
    # Draw 0 has some samples trained (the checkpoint skips it on resume): its result goes with the state,
    # which then applies draw 0 as the settled copy will once it settles; the live copy is left as it was.
    state = data.pools_state(partial=[0])
    assert state["applied"] == 1 and state["rate"] == {"1": 0.5} and state["results"] == {"1": [2, 1.0]}
    assert data.pools.applied == 0 and data.pools_state()["results"] == {"1": [2, 1.0]}


def test_dynamic_sampling_counts_each_step_and_stops_a_step_over_the_cap(caplog):
    data = DataAccounting(OverSamplingCount(max_factor=2.0), None, pass_threshold=1.0)
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.data_accounting"):
        for dropped in (True, True, True):  # 3 generated, none kept: the step keeps pulling
            data.on_pulled(group(0, 0, [0.0, 0.0], dropped=dropped), step=5)
        assert not data.cap_stops(5, held_samples=4)
        data.on_pulled(GroupResult(row_index=9, epoch=0, sequences=[object()], rewards=[1.0, 0.0]), step=5)  # kept
        assert not data.cap_stops(5, held_samples=0)  # over the cap (4 > 2 × 1), but nothing to train yet
        assert data.cap_stops(5, held_samples=2)
    assert [r.getMessage()[:80] for r in caplog.records] == [
        "step 5: dynamic sampling stopped filling the step: 4 groups generated for 1 kept"
    ]
    m = {name: value for name, value, _ in data.plan_metrics()}
    assert m == {
        "dynamic_sampling/generated_groups": 4.0,
        "dynamic_sampling/kept_groups": 1.0,
        "dynamic_sampling/generated_per_kept": 4.0,
        "dynamic_sampling/cap_hit": 1.0,
    }
    assert data.pools_state() is None


def test_rejected_prompts_are_not_generated_groups():
    data = DataAccounting(OverSamplingCount(max_factor=2.0), None, pass_threshold=1.0)
    data.on_pulled(GroupResult.rejected(3, 0), step=1)
    assert {n: v for n, v, _ in data.plan_metrics()}["dynamic_sampling/generated_groups"] == 0.0
    with pytest.raises(ValueError, match=">= 1"):
        OverSamplingCount(max_factor=0.0)


def test_without_dynamic_sampling_the_counts_are_kept_but_no_step_stops(caplog):
    data = DataAccounting(OverSamplingCount(max_factor=1.0, enforce_cap=False), None, pass_threshold=1.0,
                          dynamic=False)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.data_accounting"):
        data.on_pulled(GroupResult(row_index=9, epoch=0, sequences=[object()], rewards=[1.0, 0.0]), step=1)
        for _ in range(3):
            data.on_pulled(group(0, 0, [0.0, 0.0], dropped=True), step=1)
        assert not data.cap_stops(1, held_samples=2)
    assert not caplog.records
    m = {n: v for n, v, _ in data.plan_metrics()}
    assert (m["dynamic_sampling/generated_per_kept"], m["dynamic_sampling/cap_hit"]) == (4.0, 0.0)

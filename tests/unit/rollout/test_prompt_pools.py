"""Prompt pools on scripted sequences of group results: each transition checked against the rule worked out here."""

from __future__ import annotations

import json
import math

import pytest

from asyncgrpo.rollout.prompt_pools import PoolSettings, PromptPools, pass_fraction, worker_pools

# One cut at 0.5: pools new, hard (< 0.5), easy (>= 0.5). Only 'new' is weighted, so unseen prompts go first and
# the rest are drawn evenly once none is left: the test knows which pool every draw comes from.
NEW_FIRST = PoolSettings(thresholds=(0.5,), weights=(1.0, 0.0, 0.0), retire_at=1.0, min_groups=2, requeue_delay=3,
                         ema=0.5, seed=7)  # fmt: skip


def test_transitions_on_a_scripted_sequence():
    pools = PromptPools(4, NEW_FIRST)
    assert pools.s.names == ("new", "hard", "easy")
    first = [pools.next_prompt() for _ in range(4)]
    assert sorted(first) == [0, 1, 2, 3]  # the new pool empties first
    assert pools.next_prompt() is None and not pools.exhausted  # all four in flight: wait for a group
    # First groups: prompt 0 solved by every sample, 1 by none, 2 by half, 3 by a quarter.
    assert pools.on_group(0, 1.0) == "easy"  # rate 1.0 but one group < min_groups=2: not retired yet
    assert pools.on_group(1, 0.0) == "parked"  # nothing solved: parked until draw 4 + 3 = 7
    assert pools.on_group(2, 0.5) == "easy"  # 0.5 >= the cut
    assert pools.on_group(3, 0.25) == "hard"
    m = pools.metrics()
    assert (m["pools/new/size"], m["pools/hard/size"], m["pools/easy/size"]) == (0.0, 2.0, 2.0)  # 1 parked: hard
    assert m["pools/easy/pass_rate"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["pools/hard/pass_rate"] == pytest.approx((0.0 + 0.25) / 2)
    assert (m["pools/parked"], m["pools/retired"]) == (1.0, 0.0)
    assert math.isnan(m["pools/new/pass_rate"])
    # Draws 5-7 (draw counts 4, 5, 6) cannot take prompt 1, parked until the count reaches 7.
    second = [pools.next_prompt() for _ in range(3)]
    assert sorted(second) == [0, 2, 3]
    assert pools.draws == 7 and pools.next_prompt() == 1  # released by the delay
    # Second groups: 0 solved again -> rate 1.0 over 2 groups: retired; 3 gets 1.0 -> 0.5*0.25 + 0.5*1.0 = 0.625;
    # 2 gets 0.0 -> 0.25 (not 0: not parked); 1 solved once -> 0.5*0 + 0.5*1 = 0.5.
    assert pools.on_group(0, 1.0) == "retired"
    assert pools.on_group(3, 1.0) == "easy" and pools.rate[3] == pytest.approx(0.625)
    assert pools.on_group(2, 0.0) == "hard" and pools.rate[2] == pytest.approx(0.25)
    assert pools.on_group(1, 1.0) == "easy" and pools.rate[1] == pytest.approx(0.5)
    assert 0 not in [pools.next_prompt() for _ in range(3)]  # a retired prompt is never drawn again
    for p in (1, 2, 3):
        pools.on_group(p, 1.0)  # 1: 0.75, 2: 0.625, 3: 0.8125 -- none reaches 1.0
    assert pools.retired == {0}
    with pytest.raises(ValueError, match="not drawn"):
        pools.on_group(0, 1.0)


def test_a_parked_prompt_is_released_when_nothing_else_can_return():
    pools = PromptPools(1, NEW_FIRST)
    assert pools.next_prompt() == 0
    assert pools.on_group(0, 0.0) == "parked"  # until draw 1 + 3 = 4, but no group is in flight to get there
    assert pools.next_prompt() == 0  # released at once rather than waiting for nothing
    assert pools.on_group(0, 1.0) == "easy"
    assert pools.next_prompt() == 0
    assert pools.on_group(0, 1.0) == "easy" and pools.rate[0] == pytest.approx(0.75)  # 0.5*0.5 + 0.5*1.0


def test_all_retired_is_the_end_of_data():
    pools = PromptPools(2, PoolSettings(thresholds=(0.5,), weights=(1.0, 1.0, 1.0), retire_at=0.5, min_groups=1))
    a, b = pools.next_prompt(), pools.next_prompt()
    assert pools.on_group(a, 0.5) == "retired"
    assert pools.next_prompt() is None and not pools.exhausted  # b is still in flight
    assert pools.on_group(b, None) == "new"  # an unscored group teaches nothing: b stays new
    assert pools.next_prompt() == b
    assert pools.on_group(b, 1.0) == "retired"
    assert pools.exhausted and pools.next_prompt() is None


def test_pools_are_drawn_by_weight():
    # Fixed rates (every group returns its prompt's fraction, so the moving average never moves): prompts 0-4 stay
    # hard (0.1), 5-9 medium (0.5), 10-19 easy (0.9). Weights hard 1, medium 3, easy 0 -> 1/4 and 3/4 of draws.
    s = PoolSettings(thresholds=(0.2, 0.8), weights=(1.0, 1.0, 3.0, 0.0), retire_at=2.0, seed=3)
    pools = PromptPools(20, s)
    fraction = {p: 0.1 if p < 5 else 0.5 if p < 10 else 0.9 for p in range(20)}
    counts = {"new": 0, "hard": 0, "medium": 0, "easy": 0}
    for _ in range(4000):
        p = pools.next_prompt()
        counts[pools.pool_of(p)] += 1
        pools.on_group(p, fraction[p])
    assert counts["easy"] == 0 or counts["new"] > 0  # easy prompts are drawn only while they were still new
    rated = counts["hard"] + counts["medium"]
    assert counts["hard"] / rated == pytest.approx(0.25, abs=0.03)
    m = pools.metrics()
    assert (m["pools/hard/size"], m["pools/medium/size"], m["pools/easy/size"]) == (5.0, 5.0, 10.0)
    assert m["pools/easy/pass_rate"] == pytest.approx(0.9)


def test_state_dict_restores_the_same_draws():
    s = PoolSettings(thresholds=(0.3, 0.7), weights=(2.0, 1.0, 1.0, 1.0), requeue_delay=2, min_groups=1, seed=11)
    script = [0.0, 1.0, 0.5, 0.25, 0.75, 1.0, 0.0, 0.5]

    def advance(pools: PromptPools, steps: int, start: int) -> list[int]:
        drawn = []
        for i in range(start, start + steps):
            p = pools.next_prompt()
            if p is None:
                break
            drawn.append(p)
            pools.on_group(p, script[(p + i) % len(script)])
        return drawn

    straight = PromptPools(12, s)
    advance(straight, 15, 0)
    saved = json.loads(json.dumps(straight.state_dict()))  # the checkpoint file is JSON
    rest = advance(straight, 15, 15)
    resumed = PromptPools(12, s)
    resumed.load_state_dict(saved)
    assert advance(resumed, 15, 15) == rest
    assert resumed.state_dict() == straight.state_dict()
    with pytest.raises(ValueError, match="same dataset"):
        PromptPools(13, s).load_state_dict(saved)


def test_settings_problems_name_the_fix():
    assert PoolSettings().problems() == []
    bad = PoolSettings(thresholds=(0.8, 0.2), weights=(1.0,), ema=0.0)
    text = " ".join(bad.problems())
    assert "ascending" in text and "one weight per pool" in text and "prompt_pool_ema" in text
    with pytest.raises(ValueError, match="ascending"):
        PromptPools(3, bad)


def test_pass_fraction():
    assert pass_fraction([1.0, 0.0, 1.0, 0.5], 1.0) == 0.5
    assert pass_fraction([1.0, float("nan")], 1.0) == 1.0
    assert pass_fraction([float("nan")], 1.0) is None


def test_a_forced_draw_takes_a_prompt_in_flight_again():
    pools = PromptPools(2, NEW_FIRST)
    a, b = pools.next_prompt(), pools.next_prompt()
    assert pools.next_prompt() is None
    again = pools.next_prompt(force=True)  # the worker's iterator cannot wait: a prompt in flight is drawn again
    assert again in (a, b) and pools.in_flight[again] == 2
    pools.on_group(again, 0.5)
    pools.on_group(again, 0.5)
    assert again not in pools.in_flight and pools.groups[again] == 2


def test_the_trainers_copy_records_settled_groups_as_draws():
    pools = PromptPools(3, NEW_FIRST)
    assert pools.record(2, 0.0, count_draw=True) == "parked"  # parked until draw 1 + 3
    assert pools.parked[2] == 4 and pools.draws == 1
    assert pools.record(1, 1.0, count_draw=True) == "easy"
    with pytest.raises(ValueError, match="not a row"):
        pools.record(3, 1.0)


def test_worker_pools_resume_from_the_checkpoint_state():
    trainer_copy = PromptPools(4, NEW_FIRST)
    for p, f in [(0, 1.0), (0, 1.0), (1, 0.0), (2, 0.5)]:
        trainer_copy.record(p, f, count_draw=True)
    state = json.loads(json.dumps(trainer_copy.state_dict()))
    a, b = worker_pools(4, NEW_FIRST, state), worker_pools(4, NEW_FIRST, state)
    assert a.retired == {0} and a.parked == {1: 6} and a.draws == 4
    draws = [a.next_prompt() for _ in range(2)]
    assert draws == [b.next_prompt() for _ in range(2)]  # the same state draws the same prompts
    assert draws[0] == 3  # the one prompt still new goes first (only 'new' is weighted)
    assert 0 not in draws and 1 not in draws  # retired; parked until draw 6

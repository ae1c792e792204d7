"""Prompt pools on scripted sequences of group results: each transition checked against the rule worked out here,
and the draws checked to depend on the results alone, never on the order they came back in."""

from __future__ import annotations

import json
import math
import random

import pytest

from asyncgrpo.rollout.prompt_pools import PoolSettings, PromptPools, pass_fraction, resumed_pools

# One cut at 0.5: pools new, hard (< 0.5), easy (>= 0.5). Only 'new' is weighted, so unseen prompts go first and
# the rest are drawn evenly once none is left: the test knows which pool every draw comes from.
NEW_FIRST = PoolSettings(thresholds=(0.5,), weights=(1.0, 0.0, 0.0), retire_at=1.0, min_groups=2, requeue_delay=3,
                         ema=0.5, seed=7, lag=2)  # fmt: skip


def test_transitions_on_a_scripted_sequence():
    pools = PromptPools(4, NEW_FIRST)
    assert pools.s.names == ("new", "hard", "easy")
    # First groups: prompt 0 solved by every sample, 1 by none, 2 by half, 3 by a quarter (draws 0-3).
    assert pools.record(0, 1.0, draw=0) == "easy"  # rate 1.0 but one group < min_groups=2: not retired yet
    assert pools.record(1, 0.0, draw=1) == "parked"  # learnt at draw 1 + lag 2 + 1 = 4, parked 3 more: until 7
    assert pools.parked == {1: 7}
    assert pools.record(2, 0.5, draw=2) == "easy"  # 0.5 >= the cut
    assert pools.record(3, 0.25, draw=3) == "hard"
    pools.applied = 4  # as a worker about to make draw 6 (clock = applied + lag) would stand
    m = pools.metrics()
    assert (m["pools/new/size"], m["pools/hard/size"], m["pools/easy/size"]) == (0.0, 2.0, 2.0)  # 1 parked: hard
    assert m["pools/easy/pass_rate"] == pytest.approx((1.0 + 0.5) / 2)
    assert m["pools/hard/pass_rate"] == pytest.approx((0.0 + 0.25) / 2)
    assert (m["pools/parked"], m["pools/retired"]) == (1.0, 0.0)  # clock 6 < 7
    assert math.isnan(m["pools/new/pass_rate"])
    # Second groups: 0 solved again -> rate 1.0 over 2 groups: retired; 3 gets 1.0 -> 0.5*0.25 + 0.5*1.0 = 0.625;
    # 2 gets 0.0 -> 0.5*0.5 = 0.25 (not 0: not parked); 1 solved once -> 0.5*0 + 0.5*1 = 0.5, no longer parked.
    assert pools.record(0, 1.0, draw=4) == "retired"
    assert pools.record(3, 1.0, draw=5) == "easy" and pools.rate[3] == pytest.approx(0.625)
    assert pools.record(2, 0.0, draw=6) == "hard" and pools.rate[2] == pytest.approx(0.25)
    assert pools.record(1, 1.0, draw=7) == "easy" and pools.rate[1] == pytest.approx(0.5)
    assert pools.parked == {} and pools.retired == {0}
    assert pools.record(2, None, draw=8) == "hard" and pools.groups[2] == 2  # unscored: nothing learnt


def test_a_draw_learns_the_results_lag_draws_back_in_draw_order():
    pools = PromptPools(4, NEW_FIRST)
    first = [pools.draw(d) for d in range(3)]  # draws 0-2 see nothing (lag 2): three distinct new prompts
    assert len(set(first)) == 3
    assert not pools.ready(3)  # draw 3 must first learn draw 0's result
    pools.learn(1, first[1], 1.0)
    assert not pools.ready(3)  # draw 1 came back first: still waiting for draw 0
    pools.learn(0, first[0], 0.5)
    assert pools.ready(3) and pools.ready(4) and not pools.ready(5)  # draw 5 needs draw 2's result
    fourth = pools.draw(3)
    assert pools.applied == 1 and pools.rate == {first[0]: 0.5}  # draw 1's result waits for draw 4
    assert fourth not in first  # the last 2 draws are recent and draw 0's row is rated: the one new prompt left
    with pytest.raises(RuntimeError, match="before the results"):
        pools.draw(5)
    pools.learn(2, first[2], 0.0)
    pools.draw(4)
    assert pools.rate == {first[0]: 0.5, first[1]: 1.0}


def test_a_parked_prompt_waits_unless_nothing_else_can_be_drawn():
    s = PoolSettings(thresholds=(0.5,), weights=(1.0, 1.0, 1.0), requeue_delay=3, lag=0, seed=1)
    alone = PromptPools(1, s)
    assert alone.draw(0) == 0
    alone.learn(0, 0, 0.0)
    assert alone.draw(1) == 0 and alone.parked == {0: 0 + 0 + 1 + 3}  # parked until 4, but nothing else is left
    two = PromptPools(2, s)
    a = two.draw(0)
    two.learn(0, a, 0.0)
    for d in (1, 2, 3):  # a is parked until draw 4: the other prompt is drawn even though it was just drawn
        assert two.draw(d) == 1 - a
        two.learn(d, 1 - a, 0.5)
    seen = set()
    for d in range(4, 40):  # both eligible again: drawn by weight
        row = two.draw(d)
        seen.add(row)
        two.learn(d, row, 0.5)
    assert seen == {0, 1}


def test_all_retired_is_the_end_of_data():
    pools = PromptPools(2, PoolSettings(thresholds=(0.5,), weights=(1.0, 1.0, 1.0), retire_at=0.5, min_groups=1,
                                        lag=0))  # fmt: skip
    a = pools.draw(0)
    pools.learn(0, a, 0.5)
    b = pools.draw(1)
    assert b == 1 - a and pools.retired == {a}
    pools.learn(1, b, None)  # an unscored group teaches nothing: b stays new
    assert pools.draw(2) == b and pools.pool_of(b) == "new"
    pools.learn(2, b, 1.0)
    assert pools.draw(3) is None and pools.exhausted


def test_pools_are_drawn_by_weight():
    # Fixed rates (every group returns its prompt's fraction, so the moving average never moves): prompts 0-4 stay
    # hard (0.1), 5-9 medium (0.5), 10-19 easy (0.9). Weights hard 1, medium 3, easy 0 -> 1/4 and 3/4 of draws.
    s = PoolSettings(thresholds=(0.2, 0.8), weights=(1.0, 1.0, 3.0, 0.0), retire_at=2.0, seed=3, lag=0)
    pools = PromptPools(20, s)
    fraction = {p: 0.1 if p < 5 else 0.5 if p < 10 else 0.9 for p in range(20)}
    counts = {"new": 0, "hard": 0, "medium": 0, "easy": 0}
    for d in range(4000):
        p = pools.draw(d)
        counts[pools.pool_of(p)] += 1
        pools.learn(d, p, fraction[p])
    assert counts["easy"] == 0 or counts["new"] > 0  # easy prompts are drawn only while they were still new
    rated = counts["hard"] + counts["medium"]
    assert counts["hard"] / rated == pytest.approx(0.25, abs=0.03)
    m = pools.metrics()
    assert (m["pools/hard/size"], m["pools/medium/size"], m["pools/easy/size"]) == (5.0, 5.0, 10.0)
    assert m["pools/easy/pass_rate"] == pytest.approx(0.9)


SCRIPTED = PoolSettings(thresholds=(0.3, 0.7), weights=(2.0, 1.0, 1.0, 1.0), requeue_delay=2, min_groups=1,
                        retire_at=1.0, seed=11, lag=3)  # fmt: skip


def _fraction(row: int) -> float:
    return [0.0, 0.25, 0.5, 0.75, 1.0, 0.5][row % 6]  # a result that depends on the prompt alone


def _worker_run(pools: PromptPools, draws: range, order_seed: int, skip: dict[int, int] | None = None) -> list:
    """A worker: up to lag + 1 groups in flight, returned in a shuffled order; draws wait until ``ready``.
    Returns the (draw, row) pairs it drew; ``skip``: draws settled before a resume (not drawn again)."""
    skip = skip or {}
    order, in_flight, drawn = random.Random(order_seed), [], []
    d = draws.start
    while d < draws.stop or in_flight:
        if d < draws.stop and d in skip:
            d += 1
            continue
        if d < draws.stop and pools.ready(d):
            row = pools.draw(d)
            drawn.append((d, row))
            in_flight.append((d, row))
            d += 1
            if order.random() < 0.5:  # sometimes draw ahead while groups are out
                continue
        if in_flight:
            g, row = in_flight.pop(order.randrange(len(in_flight)))
            pools.learn(g, row, _fraction(row))
    return drawn


def test_the_draws_do_not_depend_on_the_order_groups_come_back_in():
    runs = [_worker_run(PromptPools(12, SCRIPTED), range(60), order_seed) for order_seed in (0, 1, 2)]
    assert runs[0] == runs[1] == runs[2]
    assert [d for d, _ in runs[0]] == list(range(60))
    # The trainer's copy, told the same results in yet another order, settles the same pools.
    trainer = PromptPools(12, SCRIPTED)
    for d, row in sorted(runs[0], key=lambda x: (x[0] * 7) % 60):
        trainer.learn(d, row, _fraction(row))
        trainer.settle()
    worker = PromptPools(12, SCRIPTED)
    _worker_run(worker, range(60), 5)
    assert trainer.applied == 60 - SCRIPTED.lag  # the last lag results wait for draws past the run
    worker.draw(60)  # the worker applies them when it makes its next draw; the trainer holds them as results
    assert {k: trainer.state_dict()[k] for k in ("rate", "groups", "parked", "retired")} == {
        k: worker.state_dict()[k] for k in ("rate", "groups", "parked", "retired")
    }


def test_a_resume_from_the_settled_state_draws_what_the_uninterrupted_run_drew():
    straight = _worker_run(PromptPools(12, SCRIPTED), range(60), order_seed=4)
    rows = dict(straight)
    # At the kill the trainer had settled draws 0-29 and 31, 33 (30, 32 and 34-39 were in flight or unsettled).
    settled = [*range(30), 31, 33]
    trainer = PromptPools(12, SCRIPTED)
    for d in reversed(settled):  # settled in any order
        trainer.learn(d, rows[d], _fraction(rows[d]))
        trainer.settle()
    assert trainer.applied == 30 - SCRIPTED.lag  # draws 27-29 wait for draw 30's turn, which is not settled
    saved = json.loads(json.dumps(trainer.state_dict()))  # the checkpoint file is JSON
    assert set(saved["results"]) == {"27", "28", "29", "31", "33"}
    resumed = resumed_pools(12, SCRIPTED, saved)
    again = _worker_run(resumed, range(30, 60), order_seed=9, skip={31: 1, 33: 1})
    assert again == [(d, r) for d, r in straight if d >= 30 and d not in (31, 33)]
    with pytest.raises(ValueError, match="same dataset"):
        PromptPools(13, SCRIPTED).load_state_dict(saved)
    with pytest.raises(ValueError, match="prompt_pool_lag=3"):
        PromptPools(12, PoolSettings(lag=4)).load_state_dict(saved)


def test_a_result_is_learnt_once_per_draw():
    pools = PromptPools(4, NEW_FIRST)
    row = pools.draw(0)
    pools.learn(0, row, 1.0)
    pools.learn(0, row, 0.0)  # the same draw generated again after a resume: the first result stands
    assert pools.results[0] == (row, 1.0)
    with pytest.raises(ValueError, match=f"was of row {row}"):
        pools.learn(0, (row + 1) % 4, 1.0)
    with pytest.raises(ValueError, match="not a row"):
        pools.learn(1, 4, 1.0)


def test_settings_problems_name_the_fix():
    assert PoolSettings().problems() == []
    bad = PoolSettings(thresholds=(0.8, 0.2), weights=(1.0,), ema=0.0, lag=-1)
    text = " ".join(bad.problems())
    assert "ascending" in text and "one weight per pool" in text and "prompt_pool_ema" in text
    assert "prompt_pool_lag=-1" in text
    with pytest.raises(ValueError, match="ascending"):
        PromptPools(3, bad)


def test_pass_fraction():
    assert pass_fraction([1.0, 0.0, 1.0, 0.5], 1.0) == 0.5
    assert pass_fraction([1.0, float("nan")], 1.0) == 1.0
    assert pass_fraction([float("nan")], 1.0) is None


def test_a_checkpoint_without_pools_state_starts_fresh_pools_at_its_first_unsettled_draw():
    # A run resumed with pools on from a checkpoint of a run without them: draws 0-4 and 6 were settled, rows unknown.
    pools = resumed_pools(4, PoolSettings(lag=0, min_groups=1), None, start_index=5, skip=[6, 2])
    assert pools.applied == 5 and pools.results == {6: (-1, None)}  # draw 2 is below the start: already passed
    row = pools.draw(5)
    pools.learn(5, row, 0.5)
    assert pools.ready(7)  # draw 6 counts as returned: it taught nothing
    pools.draw(7)
    assert pools.applied == 7 and pools.groups == {row: 1}

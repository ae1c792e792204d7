"""Token-budget planner (SPEC P2-P4) and the batch/* metrics, on hand-sized examples."""

from __future__ import annotations

import logging

import pytest

from asyncgrpo.packing.planner import TokenBudgetBatcher, batch_metrics, plan_step
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.packing.sample import PackSample
from tests.helpers.synthetic import grpo_samples


def _s(prompt, completion, group):
    ids = list(prompt) + list(completion)
    return PackSample(ids, [0] * len(prompt) + [1] * len(completion), [0.0] * len(ids), 1.0, group)


def _cost(n):  # attention cost of an unshared chain of n tokens: 1 + 2 + ... + n
    return n * (n + 1) // 2


def test_oversize_sample_is_dropped_with_warning(caplog):
    b = TokenBudgetBatcher(token_budget=10)
    with caplog.at_level(logging.WARNING):
        assert b.add(_s(range(5), range(100, 106), 0)) is None  # 11 tokens > 10
    assert "longer than token_budget=10" in caplog.text
    assert b.take_dropped_count() == 1 and b.take_dropped_count() == 0
    assert b.pending_samples == 0


def test_one_process_fills_a_row_per_group_then_closes():
    # prompt of 10 + four 5-token completions: 9 shared tokens + 4 x (copy of the 10th + 5) = 33 tokens
    groups = [
        [_s(range(g * 50, g * 50 + 10), range(1000 + 10 * i, 1005 + 10 * i), g) for i in range(4)] for g in (0, 1)
    ]
    b = TokenBudgetBatcher(token_budget=40)
    closed = [b.add(s) for s in groups[0] + groups[1]]
    assert closed[:4] == [None] * 4 and closed[5:] == [None] * 3
    first = closed[4]  # the first sample of group 1 did not fit next to group 0 (33 + 15 > 40)
    (row,) = first.pack()
    assert row.num_tokens == 33 and {s.group_id for s in row.samples} == {0}
    (rest,) = b.flush().pack()
    assert rest.num_tokens == 33 and {s.group_id for s in rest.samples} == {1}


def test_full_group_row_overflows_only_without_raising_peak_load():
    budget = 25
    a1 = _s(range(10), range(100, 110), "A")  # 20 tokens, load 210
    b1 = _s(range(200, 203), range(300, 302), "B")  # 5 tokens, load 15
    b = TokenBudgetBatcher(token_budget=budget, num_processes=2)
    assert b.add(a1) is None and b.add(b1) is None  # B: lowest resulting load is the empty row 1
    rows = b._open.rows
    assert [len(r) for r in rows] == [1, 1] and rows[0].attention_cost == _cost(20) == 210
    # A's row is full (20 + copy + 5 = 26 > 25); row 1 takes it: 5 + 15 = 20 tokens, load 15 + 120 <= 210
    a2 = _s(range(10), range(400, 405), "A")
    assert b.add(a2) is None
    assert rows[1].num_tokens == 20 and rows[1].attention_cost == 15 + _cost(15)
    # another A sample: row 0 full, row 1 would exceed the budget (20 + 15 > 25) -> the micro-batch closes
    a3 = _s(range(10), range(500, 505), "A")
    closed = b.add(a3)
    assert closed is not None and closed.num_samples == 3 and b.pending_samples == 1


def test_full_group_row_closes_when_overflow_would_raise_peak():
    b = TokenBudgetBatcher(token_budget=30, num_processes=2)
    b.add(_s(range(10), range(100, 110), "A"))  # row 0: 20 tokens, load 210
    b.add(_s(range(200, 203), range(300, 302), "B"))  # row 1: 5 tokens, load 15
    # 9 shared + copy + 10 = 31 > 30 in row 0; in row 1 it fits (25) but load 15 + 210 > 210
    closed = b.add(_s(range(10), range(400, 410), "A"))
    assert closed is not None and [len(r) for r in closed.rows] == [1, 1]


def test_new_groups_go_to_the_least_loaded_row():
    b = TokenBudgetBatcher(token_budget=1000, num_processes=2)
    b.add(_s(range(10), range(100, 110), 0))  # row 0, load 210
    b.add(_s(range(20, 25), range(100, 105), 1))  # row 1 (load 55 < 210 + 55)
    b.add(_s(range(30, 36), range(100, 102), 2))  # row 1 again: 55 + 36 < 210 + 36
    assert [sorted(r.group_ids) for r in b._open.rows] == [[0], [1, 2]]


def test_plan_step_pulls_until_enough_micro_batches():
    samples = grpo_samples(num_groups=5, group_size=4, prompt_len=30, completion_len=(5, 20), vocab_size=1000)
    it = iter(samples)
    b = TokenBudgetBatcher(token_budget=150)
    step = plan_step(b, lambda: next(it, None), gradient_accumulation_steps=2)
    assert len(step) == 2 and b.pending_samples >= 1
    for mb in step:
        for row in mb.pack():
            assert 0 < row.num_tokens <= 150
    rest = plan_step(b, lambda: next(it, None), gradient_accumulation_steps=10)
    placed = sum(mb.num_samples for mb in step + rest)
    assert placed == len(samples)


def test_batch_metrics_by_hand():
    # row 0: docs/design.md's packing example (8 forwarded of 10 flat tokens, 4 trained, load 27);
    # row 1: one 4-token sample
    r0 = pack_samples([_s([1, 2, 3], [10, 11], "g"), _s([1, 2, 3], [20, 21], "g")])
    r1 = pack_samples([_s([7, 8], [9, 10], "h")])
    assert (r0.attention_cost, r1.attention_cost) == (27, 10)
    m = batch_metrics([[r0, r1]], token_budget=16, dropped_oversize=2)
    expected = {
        "batch/forwarded_tokens_per_step": 12.0,
        "batch/trained_tokens_per_step": 6.0,
        "batch/samples_per_step": 3.0,
        "batch/groups_per_step": 2.0,
        "batch/microbatches_per_step": 1.0,
        "batch/masked_token_frac": 1 - 6 / 12,
        "batch/samples_per_row": 1.5,
        "batch/row_tokens_mean": 6.0,
        "batch/row_tokens_max": 8.0,
        "batch/row_fill_frac": 6 / 16,
        "batch/row_imbalance": 27 / 18.5,
        "batch/packing_ratio": 14 / 12,
        "batch/pad_frac": 4 / 16,
        "batch/dropped_oversize_count": 2.0,
    }
    assert m == pytest.approx(expected)


def test_flat_planner_forwards_every_token():
    samples = grpo_samples(num_groups=2, group_size=3, prompt_len=20, completion_len=(4, 8), vocab_size=500)
    b = TokenBudgetBatcher(token_budget=10_000, share_prefixes=False)
    for s in samples:
        b.add(s)
    rows = b.flush().pack()
    assert batch_metrics([rows], 10_000)["batch/packing_ratio"] == 1.0


def test_invalid_budget_message():
    with pytest.raises(ValueError, match="token_budget"):
        TokenBudgetBatcher(token_budget=0)


def _group_tokens(samples):
    return pack_samples(samples).num_tokens


def test_keep_groups_places_each_group_in_one_row_when_the_budget_allows():
    # groups of 8 x (prompt 40 + completions 10..30): ~ 210 tokens each, one per 300-token row
    samples = grpo_samples(num_groups=5, group_size=8, prompt_len=40, completion_len=(10, 30), vocab_size=1000, seed=1)
    by_group: dict = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    alone = {g: _group_tokens(v) for g, v in by_group.items()}
    budget = 300
    assert all(budget / 2 < t <= budget for t in alone.values())

    def rows_of(keep_groups):
        it = iter(samples)
        b = TokenBudgetBatcher(token_budget=budget, keep_groups=keep_groups)
        return [r for mb in plan_step(b, lambda: next(it, None), gradient_accumulation_steps=100) for r in mb.pack()]

    split = rows_of(False)
    kept = rows_of(True)
    assert any(len({s.group_id for s in r.samples} & {s.group_id for s in o.samples}) for r in split for o in split
               if r is not o)  # fmt: skip  # sample-by-sample filling splits a group across rows
    seen = [g for r in kept for g in {s.group_id for s in r.samples}]
    assert sorted(seen) == sorted(by_group)  # every group in exactly one row
    assert sum(len(r.samples) for r in kept) == len(samples)
    assert all(r.num_tokens <= budget for r in kept)
    assert sum(r.num_tokens for r in kept) == sum(alone.values())  # each prompt forwarded once
    assert sum(r.num_tokens for r in split) > sum(r.num_tokens for r in kept)


def test_keep_groups_splits_only_a_group_larger_than_the_budget():
    big = [_s(range(20), range(100 + 10 * i, 110 + 10 * i), "big") for i in range(6)]  # 19 + 6 x 11 = 85 tokens
    small = [_s(range(500, 505), range(600 + 3 * i, 603 + 3 * i), "small") for i in range(2)]  # 4 + 2 x 4 = 12
    b = TokenBudgetBatcher(token_budget=50, keep_groups=True)
    closed = [mb for mb in (b.add(s) for s in big + small) if mb is not None]
    assert b.pending_samples == len(big) + len(small) - sum(mb.num_samples for mb in closed)
    while (mb := b.flush()) is not None:
        closed.append(mb)
    rows = [r for mb in closed for r in mb.pack()]
    assert sum(len(r.samples) for r in rows) == 8 and all(r.num_tokens <= 50 for r in rows)
    # a row holds the prompt and 2 completions (30 + 11 = 41 tokens; a third makes 52 > 50): 3 rows
    assert sum("big" in {s.group_id for s in r.samples} for r in rows) == 3
    assert sum("small" in {s.group_id for s in r.samples} for r in rows) == 1


def test_keep_groups_take_open_samples_returns_the_held_group():
    b = TokenBudgetBatcher(token_budget=100, keep_groups=True)
    first = [_s(range(10), [50 + i], "A") for i in range(3)]
    second = _s(range(30, 40), [60], "B")
    for s in first + [second]:
        assert b.add(s) is None
    assert b.pending_samples == 4
    assert b.take_open_samples() == first + [second] and b.pending_samples == 0


def test_keep_groups_with_two_processes_balances_whole_groups():
    samples = grpo_samples(num_groups=4, group_size=4, prompt_len=30, completion_len=(5, 15), vocab_size=1000, seed=2)
    b = TokenBudgetBatcher(token_budget=200, num_processes=2, keep_groups=True)
    closed = [mb for mb in (b.add(s) for s in samples) if mb is not None]
    while (mb := b.flush()) is not None:
        closed.append(mb)
    rows = [r for mb in closed for r in mb.rows]
    groups = [g for r in rows for g in r.group_ids]
    assert sorted(groups) == sorted({s.group_id for s in samples})  # each group in exactly one row
    assert sum(len(r) for r in rows) == len(samples) and all(r.num_tokens <= 200 for r in rows)
    assert all(len(r) for mb in closed for r in mb.rows[:1])  # no micro-batch starts empty
    assert min(len(r.group_ids) for r in closed[0].rows) >= 1  # the second row of the first micro-batch is used


def test_keep_groups_places_a_group_that_must_not_wait_sample_by_sample():
    # A: prompt of 10 + two 5-token completions = 9 shared + 2 x (copy + 5) = 21 tokens. B (another prompt, three
    # completions) is 27 tokens alone: it does not fit whole next to A (budget 40), but its first sample (15) does.
    a = [_s(range(10), range(100 + 10 * i, 105 + 10 * i), "A") for i in range(2)]
    bs = [_s(range(20, 30), range(200 + 10 * i, 205 + 10 * i), "B") for i in range(3)]
    c = _s(range(40, 50), range(300, 305), "C")

    def first_micro_batch(must_not_wait):
        b = TokenBudgetBatcher(token_budget=40, keep_groups=True, must_not_wait=must_not_wait)
        closed = [mb for mb in (b.add(s) for s in a + bs + [c]) if mb is not None]
        assert len(closed) == 1
        assert [s.group_id for s in b.held_samples()].count("C") == 1  # held, not removed
        (row,) = closed[0].rows
        return sorted(s.group_id for s in row.samples), row.num_tokens

    assert first_micro_batch(None) == (["A", "A"], 21)  # B waits, whole, for the next micro-batch
    assert first_micro_batch(lambda group: group[0].group_id == "B") == (["A", "A", "B"], 36)  # 21 + 15


# ---- a step that need not wait for the group that would close it (issue 41) -------------------------------------------
def _group(g: int, n: int = 2, prompt: int = 10, completion: int = 5) -> list[PackSample]:
    """Group ``g``: a prompt of its own and ``n`` completions: prompt - 1 shared + n x (copy + completion) tokens."""
    return [_s(range(100 * g, 100 * g + prompt), range(10_000 + 100 * g + 10 * i, 10_000 + 100 * g + 10 * i + completion), g)
            for i in range(n)]  # fmt: skip


def test_end_group_places_the_group_at_once():
    b = TokenBudgetBatcher(token_budget=50, keep_groups=True)  # a group of 2: 9 + 2 x 6 = 21 tokens
    for s in _group(0):
        assert b.add(s) is None
    assert b.end_group() is None  # placed in the open row, no micro-batch closed
    assert b.pending_samples == 2 and b._open.rows[0].num_tokens == 21
    for s in _group(1):
        b.add(s)
    assert b.end_group() is None and b._open.rows[0].num_tokens == 42  # both fit: 42 <= 50
    for s in _group(2):
        b.add(s)
    closed = b.end_group()  # 63 > 50: the open micro-batch closes without a sample of a fourth group
    assert closed is not None and sorted(closed.rows[0].group_ids) == [0, 1]
    assert b._open.rows[0].group_ids == {2} and b.end_group() is None  # nothing held: a no-op


def test_cannot_take_a_group_compares_the_room_with_the_smallest_recent_group():
    b = TokenBudgetBatcher(token_budget=50, keep_groups=True)
    assert not b.cannot_take_a_group()  # empty, and no group seen
    for g in (0, 1):
        for s in _group(g):
            b.add(s)
        b.end_group()
    assert b.cannot_take_a_group()  # 42 of 50: 8 left, the smallest group seen is 21
    b.add(_group(2)[0])
    assert not b.cannot_take_a_group()  # a group is being pulled: it must end first
    assert b.end_group() is not None  # a group of one sample (15 tokens) does not fit the 8 left: it closes one
    assert not b.cannot_take_a_group()  # 15 in the open row, 35 left >= the smallest (15)
    one = TokenBudgetBatcher(token_budget=50, keep_groups=False)
    for s in _group(0) + _group(1):
        one.add(s)
    assert not one.cannot_take_a_group()  # only with keep_groups (groups are what it measures)


def test_cannot_take_a_group_needs_every_row_full():
    b = TokenBudgetBatcher(token_budget=25, num_processes=2, keep_groups=True)
    for s in _group(0):
        b.add(s)
    b.end_group()  # row 0: 21 of 25; row 1 empty
    assert not b.cannot_take_a_group()
    for s in _group(1):
        b.add(s)
    b.end_group()
    assert b.cannot_take_a_group()  # both rows at 21: 4 left in each


def test_plan_step_follows_the_pull_marks():
    from asyncgrpo.packing import CLOSE, GROUP_END

    b = TokenBudgetBatcher(token_budget=50, keep_groups=True)
    script = iter([*_group(0), GROUP_END, *_group(1), GROUP_END, CLOSE, *_group(2), GROUP_END, *_group(3), GROUP_END])
    pulled = []

    def pull():
        item = next(script, None)
        pulled.append(item)
        return item

    (first,) = plan_step(b, pull, gradient_accumulation_steps=1)
    assert sorted(first.rows[0].group_ids) == [0, 1] and pulled[-1] is CLOSE  # closed without group 2
    (second,) = plan_step(b, pull, gradient_accumulation_steps=1)
    assert sorted(second.rows[0].group_ids) == [2, 3] and pulled[-1] is None  # the end of data flushed it


def test_after_groups_larger_than_a_row_the_room_is_compared_with_a_sample():
    b = TokenBudgetBatcher(token_budget=30, keep_groups=True)
    for s in _group(0, n=4):  # 9 + 4 x 6 = 33 tokens > 30: placed sample by sample (15, then 6 each: 27, then 15)
        b.add(s)
    assert b.end_group() is not None  # the fourth sample did not fit the 3 left: it opened the next micro-batch
    assert not b.cannot_take_a_group()  # 15 of 30 in the open row: a sample (15) still fits
    b.add(_group(1, completion=14)[0])  # 24 tokens: does not fit the 15 left
    assert b.end_group() is not None and b.cannot_take_a_group()  # 24 in the row, 6 left < the shortest sample

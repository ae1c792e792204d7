"""What fills a step around tied groups, dynamic sampling on and off (issue 36), against steps worked out by hand.

The trainer's side is real (``RolloutSource``, ``TokenBudgetBatcher``, ``DataAccounting``); the worker is played by
``ScriptedGroups``: one scripted group per prompt, kept (2 samples with a signal) or tied (dropped: only its size,
``row_tokens``, as the worker sends it), then the end marker. Every group has a 10-token prompt and two 15-token
completions: a row forwards the prompt once, both completions, and the prompt's last token once more (it predicts
the first token of two completions, docs/design.md "Packing"), 10 + 2 × 15 + 1 = 41 tokens. With ``token_budget``
100 and one row per step, two groups fit a step (82) and a third does not (123).
"""

from __future__ import annotations

import logging
from collections import deque

from asyncgrpo.packing import PackSample, TokenBudgetBatcher
from asyncgrpo.packing.trie import PrefixTrie
from asyncgrpo.rollout.dynamic_sampling import OverSamplingCount, row_tokens
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.trainer.data_accounting import DataAccounting
from asyncgrpo.trainer.rollout_source import RolloutSource
from asyncgrpo.trainer.step_fill import is_share, tied_shares
from asyncgrpo.types import TrainingSequence
from tests.helpers.scripted_workers import QuietWorker

GROUP_TOKENS = 10 + 2 * 15 + 1  # forwarded tokens of one group in a row (module docstring)


def _samples(row: int) -> list[TrainingSequence]:
    prompt = [1000 + 100 * row + j for j in range(10)]
    out = []
    for k in range(2):
        completion = [50_000 + 1000 * row + 100 * k + j for j in range(15)]
        mask = [0] * 10 + [1] * 15
        out.append(TrainingSequence(prompt + completion, mask, [-0.5 if m else 0.0 for m in mask], 1.0 - 2 * k, 0,
                                    row + 1, row))  # fmt: skip
    return out


class ScriptedGroups(QuietWorker):
    """The groups of ``script`` in order ("K": kept, "T": tied), one per prompt, then the end marker."""

    def __init__(self, script: str) -> None:
        super().__init__()
        self.script = deque(enumerate(script))

    def get_sample(self, timeout: float) -> GroupResult:
        if not self.script:
            return GroupResult.end_of_data()
        row, kind = self.script.popleft()
        if kind == "T":
            return GroupResult(row, 0, row + 1, 0, [], dropped=True, rewards=[1.0, 1.0], row_tokens=GROUP_TOKENS)
        seqs = _samples(row)
        return GroupResult(row, 0, row + 1, 0, seqs, rewards=[1.0, 0.0], tokens=sum(len(s.input_ids) for s in seqs))


def _steps(script: str, dynamic: bool, steps: int, max_factor: float = 8.0) -> list[tuple[list[int], dict]]:
    """(trained prompts, the step's dynamic_sampling/* metrics) of each of the first ``steps`` steps."""
    data = DataAccounting(OverSamplingCount(max_factor, enforce_cap=dynamic), None, pass_threshold=1.0, dynamic=dynamic)
    source = RolloutSource(ScriptedGroups(script), TokenBudgetBatcher(100, 1, keep_groups=True), 1, 100, len(script),
                           data=data)  # fmt: skip
    out = []
    for step in range(steps):
        micro = source.next_step(step)
        trained = sorted({s.meta.row_index for mb in micro for row in mb.rows for s in row.samples})
        assert all(len(row) % 2 == 0 for mb in micro for row in mb.rows)  # whole groups, never a share
        source.step_done(micro)
        m = {n.split("/")[1]: v for n, v, _ in source.take_metrics() if n.startswith("dynamic_sampling/")}
        out.append((trained, m))
    return out


SCRIPT = "KTKKTTKKTKKKKKKK"  # prompts 0..15


def test_a_group_takes_as_many_tokens_as_a_row_forwards():
    assert row_tokens(_samples(3)) == GROUP_TOKENS
    assert row_tokens(_samples(3)[:1]) == 10 + 15  # one completion: no token forwarded twice


def test_on_tied_groups_take_no_room_and_steps_fill_with_kept_groups():
    # Step 1 pulls 0K 1T 2K: 0 and 2 fill 82 of 100 and no group (41) fits the rest; 3K is ready, so it is pulled
    # (it might have fitted) and placed as soon as it is complete: it does not fit (123) and closes the step.
    # Step 2 starts with 3 (carried), pulls 4T 5T 6K and the ready 7K, which closes it. Step 3: 7, 8T 9K, 10K.
    steps = _steps(SCRIPT, dynamic=True, steps=3)
    assert [t for t, _ in steps] == [[0, 2], [3, 6], [7, 9]]
    assert [(m["generated_groups"], m["kept_groups"], m["cap_hit"]) for _, m in steps] == [
        (4.0, 3.0, 0.0), (4.0, 2.0, 0.0), (3.0, 2.0, 0.0)]  # fmt: skip
    assert steps[0][1]["generated_per_kept"] == 4 / 3


def test_off_tied_groups_keep_their_room_and_a_step_of_ties_keeps_pulling():
    # Step 1 pulls 0K 1T 2K: 0 and 1's share fill 82, 2 does not fit: one group trained (0).
    # Step 2: 2 and 3 fill 82; 4's share closes it. Step 3: the shares of 4 and 5 fill 82 and 6 closes a step
    # with nothing to train: it keeps pulling (7K 8T): 6 and 7 fill 82, 8's share closes it.
    steps = _steps(SCRIPT, dynamic=False, steps=3)
    assert [t for t, _ in steps] == [[0], [2, 3], [6, 7]]
    assert [(m["generated_groups"], m["kept_groups"], m["cap_hit"]) for _, m in steps] == [
        (3.0, 2.0, 0.0), (2.0, 1.0, 0.0), (4.0, 2.0, 0.0)]  # fmt: skip
    assert steps[1][1]["generated_per_kept"] == 2.0  # step 2 pulled 3K 4T (it trained 2, pulled before)


def test_off_never_over_samples_past_the_cap():
    # Factor 1 would stop a step at its first tie after a kept group; off, the cap does not apply.
    assert [t for t, _ in _steps("KTTTKKK", dynamic=False, steps=1, max_factor=1.0)] == [[0]]
    steps = _steps("KTTTKKK", dynamic=False, steps=2, max_factor=1.0)
    assert [t for t, _ in steps][1] == [4, 5] and all(m["cap_hit"] == 0.0 for _, m in steps)


def test_the_cap_stops_a_step_which_trains_what_it_holds(caplog):
    # Factor 2: 0K 1T 2T is 3 generated for 1 kept (> 2): step 1 stops and trains group 0 alone (30 tokens, not 60).
    # Step 2 pulls 3T 4K 5K 6K (4 for 3 kept, under the cap) and is full: 4 and 5.
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.data_accounting"):
        steps = _steps("KTTTKKKKK", dynamic=True, steps=2, max_factor=2.0)
    assert [t for t, _ in steps] == [[0], [4, 5]]
    assert [(m["generated_groups"], m["kept_groups"], m["cap_hit"]) for _, m in steps] == [
        (3.0, 1.0, 1.0), (4.0, 3.0, 0.0)]  # fmt: skip
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("step 1: dynamic sampling stopped filling the step: 3 groups generated for 1 kept")
    assert "trains the 2 samples it holds" in line and "dynamic_sampling_max_factor" in line


def test_with_none_kept_the_cap_waits_for_a_kept_group():
    # Five ties, then 5K: 6 generated for 1 kept passes factor 2 at once, so the step trains that group alone.
    steps = _steps("TTTTTKKKK", dynamic=True, steps=2, max_factor=2.0)
    assert [t for t, _ in steps] == [[5], [6, 7]]
    assert (steps[0][1]["generated_groups"], steps[0][1]["cap_hit"]) == (6.0, 1.0)


def test_a_tied_group_larger_than_a_row_takes_rows_as_its_samples_would():
    # 250 tokens in rows of 100: three pieces of 84, 83, 83, which share nothing with each other or a kept group.
    shares = tied_shares(7, 8, 250, token_budget=100, queued_at=0.0)
    assert [len(s) for s in shares] == [84, 83, 83] and all(is_share(s) for s in shares)
    assert tied_shares(7, 8, 0, token_budget=100, queued_at=0.0) == []
    trie = PrefixTrie()
    for s in shares[:2]:
        trie.insert(s)
    trie.insert(PackSample.from_sequence(_samples(1)[0], meta=None))
    assert trie.num_tokens == 84 + 83 + 25
    assert all(s.meta.num_tokens == 0 and s.num_trained == 0 for s in shares)  # nothing queued (G3), nothing trained

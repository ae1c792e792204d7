"""A step closes once its row can take no further group, without waiting for the group that would close it (#41).

The trainer's side is real (``RolloutSource``, ``TokenBudgetBatcher``); the worker is ``ArrivingGroups``: groups that
are ready now, and groups that arrive only for a caller willing to wait (``get_sample`` with more than the ready
poll's timeout). Every call is recorded with its timeout, so a test sees whether the step waited, and for what.
Each group: a 10-token prompt of its own and two 15-token completions, 10 + 2 x 15 + 1 = 41 forwarded tokens; with
``token_budget`` 100 two groups fill a row (82) and a third does not (123).
"""

from __future__ import annotations

from collections import deque

from asyncgrpo.packing import TokenBudgetBatcher
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.trainer.rollout_source import READY_POLL_S, RolloutSource
from asyncgrpo.types import TrainingSequence
from tests.helpers.scripted_workers import QuietWorker


def _group(row: int, completion: int = 15) -> GroupResult:
    prompt = [1000 + 100 * row + j for j in range(10)]
    seqs = []
    for k in range(2):
        ids = prompt + [50_000 + 1000 * row + 100 * k + j for j in range(completion)]
        mask = [0] * 10 + [1] * completion
        seqs.append(TrainingSequence(ids, mask, [-0.5 if m else 0.0 for m in mask], 1.0 - 2 * k, 0, row + 1, row))
    return GroupResult(row, 0, row + 1, 0, seqs, rewards=[1.0, 0.0], tokens=sum(len(s.input_ids) for s in seqs))


class ArrivingGroups(QuietWorker):
    """``ready`` groups are handed out at once; ``later`` ones only to a call that waits (a long timeout)."""

    def __init__(self, ready: list[GroupResult], later: list[GroupResult]) -> None:
        super().__init__()
        self.ready, self.later = deque(ready), deque(later)
        self.calls: list[tuple[float, int | None]] = []  # (timeout asked, row handed out or None)

    def get_sample(self, timeout: float) -> GroupResult:
        source = self.ready if self.ready or timeout <= READY_POLL_S else self.later
        res = source.popleft() if source else None
        self.calls.append((timeout, None if res is None else res.row_index))
        if res is None:
            raise TimeoutError(f"nothing within {timeout}s")
        return res


def _source(worker: ArrivingGroups) -> RolloutSource:
    return RolloutSource(worker, TokenBudgetBatcher(100, 1, keep_groups=True), 1, 100, 100, sample_timeout=5.0)


def _trained(micro) -> list[int]:
    return sorted({s.meta.row_index for mb in micro for row in mb.rows for s in row.samples})


def test_a_full_row_does_not_wait_for_the_group_that_would_close_it():
    worker = ArrivingGroups([_group(0), _group(1)], [_group(2), _group(3)])
    source = _source(worker)
    assert _trained(source.next_step(0)) == [0, 1]
    # Two ready groups, then one look (the ready poll) that finds nothing: the step closes without waiting.
    assert worker.calls[2:] == [(READY_POLL_S, None)]
    assert source.batcher.pending_samples == 0  # nothing pulled ahead, nothing carried
    worker.calls.clear()
    micro = source.next_step(1)  # an empty row: it waits for groups 2 and 3 (they arrive), then closes again
    assert _trained(micro) == [2, 3]
    assert [row for t, row in worker.calls if t > READY_POLL_S] == [2, 3] and worker.calls[-1] == (READY_POLL_S, None)


def test_a_ready_group_is_still_pulled_and_carried():
    # Group 2 is ready when the row is full: pulled (it might have fitted), it does not fit and waits for step 2.
    worker = ArrivingGroups([_group(0), _group(1), _group(2)], [_group(3)])
    source = _source(worker)
    assert _trained(source.next_step(0)) == [0, 1]
    assert [row for _, row in worker.calls] == [0, 1, 2]  # placed on its own end, not on a fourth group's arrival
    assert {s.meta.row_index for s in source.carried_samples()} == {2}
    assert _trained(source.next_step(1)) == [2, 3]


def test_a_row_with_room_for_a_group_waits_for_one():
    # The first group is short (completions of 5 tokens: 21 forwarded), the next two 41 each: after 0 and 1 (62)
    # the row has 38 left, which the smallest group seen (21) fits: the step waits for group 2 (41: 103 > 100).
    worker = ArrivingGroups([_group(0, completion=5), _group(1)], [_group(2)])
    source = _source(worker)
    assert _trained(source.next_step(0)) == [0, 1]
    assert [row for _, row in worker.calls] == [0, 1, 2] and all(t > READY_POLL_S for t, _ in worker.calls)
    assert {s.meta.row_index for s in source.carried_samples()} == {2}

"""The scheduler admits waiting sequences in batches while others run, within a bounded delay.

The reference is a hand count: with ``max_num_seqs`` 16 the batch size is 16 // 8 = 2 admissible sequences
(waiting, with a free slot each), and a single one is admitted after ``MAX_ADMIT_DELAY`` decode steps, never later.
"""

from __future__ import annotations

import torch

from asyncgrpo.server.engine.kv_cache import KVCache
from asyncgrpo.server.engine.request import Request, SamplingParams
from asyncgrpo.server.engine.scheduler import MAX_ADMIT_DELAY, Scheduler, Sequence


def _scheduler(max_num_seqs: int = 16) -> Scheduler:
    kv = KVCache(1, 256, 4, 1, 2, torch.float32, torch.device("cpu"), enable_prefix_caching=False)
    return Scheduler(kv, max_num_seqs, max_batched_tokens=4096)


def _seq(i: int) -> Sequence:
    return Sequence(Request(f"r{i}", [1, 2, 3, i + 4], SamplingParams(max_tokens=8)), on_finish=lambda out: None)


def _decode(s: Scheduler) -> None:
    batch = s.schedule()
    assert batch is not None and not batch.is_prefill
    s.note_decode_step()


def test_admissions_are_batched_and_a_free_slot_waits_at_most_the_delay():
    s = _scheduler()
    seqs = [_seq(i) for i in range(24)]
    for q in seqs:
        s.add(q)
    first = s.schedule()
    assert first is not None and first.is_prefill and len(first.seqs) == 16  # nothing runs: admit all that fit
    _decode(s)

    s.remove(s.running[0])  # one slot frees: below the batch size, so decode steps go on...
    for _ in range(MAX_ADMIT_DELAY):
        assert not s.admission_due()
        _decode(s)
    assert s.admission_due()  # ...for exactly MAX_ADMIT_DELAY steps, then the slot is filled
    batch = s.schedule()
    assert batch is not None and batch.is_prefill and [q.request_id for q in batch.seqs] == ["r16"]
    _decode(s)  # after a prefill the next step decodes (alternation)

    s.remove(s.running[0])
    s.remove(s.running[0])  # two free slots = the batch size: admitted at once, in arrival order
    assert s.admission_due()
    batch = s.schedule()
    assert batch is not None and batch.is_prefill and [q.request_id for q in batch.seqs] == ["r17", "r18"]


def test_small_engines_admit_as_soon_as_a_slot_frees():
    s = _scheduler(max_num_seqs=4)  # 4 // 8 -> batch size 1: the old behaviour
    for i in range(6):
        s.add(_seq(i))
    assert len(s.schedule().seqs) == 4
    _decode(s)
    s.remove(s.running[0])
    batch = s.schedule()
    assert batch is not None and batch.is_prefill and [q.request_id for q in batch.seqs] == ["r4"]


def test_arrivals_while_slots_are_free_are_batched_too():
    s = _scheduler()
    s.add(_seq(0))
    assert s.schedule().is_prefill
    for _ in range(3 * MAX_ADMIT_DELAY):  # nothing waiting: no admission, no delay counted
        _decode(s)
    assert not s.admission_due()
    s.add(_seq(1))  # one arrival with 15 free slots waits for company...
    for _ in range(MAX_ADMIT_DELAY - 1):
        assert not s.admission_due()
        _decode(s)
    s.add(_seq(2))  # ...and a second one makes a batch of 2: admitted at the next step boundary
    assert s.admission_due()
    batch = s.schedule()
    assert batch is not None and [q.request_id for q in batch.seqs] == ["r1", "r2"]

"""trainer/heap.py: the heap frozen for the block and handed back after it; someone else's freeze left alone."""

from __future__ import annotations

import gc

import pytest

from asyncgrpo.trainer import heap
from asyncgrpo.trainer.heap import frozen_heap


def test_the_block_freezes_what_exists_and_gives_it_back():
    gc.unfreeze()  # (an in-process engine of an earlier test in this process may have frozen it)
    tracked = len(gc.get_objects())
    with frozen_heap() as froze:
        assert froze and gc.get_freeze_count() >= tracked - 100  # what existed is in the permanent generation
        assert len(gc.get_objects()) < 100  # ... which the collector's generations no longer hold
    assert gc.get_freeze_count() == 0 and len(gc.get_objects()) >= tracked - 100


def test_a_failure_inside_still_unfreezes():
    gc.unfreeze()
    with pytest.raises(RuntimeError), frozen_heap():
        raise RuntimeError("boom")
    assert gc.get_freeze_count() == 0


def test_a_heap_frozen_by_its_owner_stays_frozen(monkeypatch):
    gc.unfreeze()
    monkeypatch.setattr(heap, "_PERMANENT_AT_IMPORT", 0)  # as a 3.11 interpreter starts
    gc.freeze()
    try:
        count = gc.get_freeze_count()
        with frozen_heap() as froze:
            assert not froze
        # not unfrozen under its owner (an unfreeze empties the permanent generation; a frozen object that dies
        # meanwhile, say a frame another thread let go, leaves it, so the count may drop by a few, never to 0)
        assert gc.get_freeze_count() >= count - 100 > 0
    finally:
        gc.unfreeze()


def test_what_the_interpreter_froze_at_its_start_is_no_owners_freeze(monkeypatch):
    """Python 3.12 starts with a few hundred objects in the permanent generation: the block still freezes the heap
    (it did not on the GPU machine's 3.12, and transformers' ``gc.collect()`` at ``train()``'s start took 0.2 s)."""
    gc.unfreeze()
    gc.freeze()  # stands for the objects the interpreter froze before this module was imported
    monkeypatch.setattr(heap, "_PERMANENT_AT_IMPORT", gc.get_freeze_count())
    try:
        garbage = [[i] for i in range(1000)]  # made after the import: the block must freeze them
        with frozen_heap() as froze:
            assert froze and len(gc.get_objects()) < 100
        del garbage
    finally:
        gc.unfreeze()

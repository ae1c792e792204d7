"""How a step's packed rows are shared out among processes (T7) and the global normaliser each gets (L5)."""

from __future__ import annotations

import pytest

from asyncgrpo.packing import PackSample, pack_samples
from asyncgrpo.trainer.step_rows import split_rows


def _row(trained: int, prompt: int = 3):
    """One sample: ``prompt`` untrained tokens, then ``trained`` trained ones."""
    n = prompt + trained
    return pack_samples([PackSample(list(range(n)), [0] * prompt + [1] * trained, [0.0] * n, 1.0, 0)])


def test_each_process_gets_its_row_and_the_micro_batch_global_normaliser():
    micro = [[_row(5), _row(3)], [_row(2), _row(0)]]  # step of 2 micro-batches, 2 processes
    shares = split_rows(micro, gradient_accumulation_steps=2, num_processes=2)
    assert [[s["row"] for s in share] for share in shares] == [[micro[0][0], micro[1][0]], [micro[0][1], micro[1][1]]]
    # sum over processes' tokens x GA, divided by the processes the gradient reduction averages over
    assert [s["normalizer"] for s in shares[0]] == [pytest.approx(8 * 2 / 2), pytest.approx(2 * 2 / 2)]
    assert [s["normalizer"] for s in shares[1]] == [s["normalizer"] for s in shares[0]]  # one number per micro-batch


def test_a_process_without_a_row_still_gets_an_entry_per_micro_batch():
    shares = split_rows([[_row(4)]], gradient_accumulation_steps=1, num_processes=3)
    assert [len(s) for s in shares] == [1, 1, 1]
    assert shares[1][0]["row"] is None and shares[2][0]["row"] is None
    assert shares[2][0]["normalizer"] == pytest.approx(4 / 3)


def test_the_end_of_data_gives_every_process_an_empty_step():
    assert split_rows([], gradient_accumulation_steps=4, num_processes=2) == [[], []]

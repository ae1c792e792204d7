"""Decoding one step ahead (the next step launched from the device-side tokens of the step in flight) gives the
same tokens, log-probs and weight-version spans as stepping synchronously, for greedy and seeded requests."""

from __future__ import annotations

import threading

import pytest

from asyncgrpo.recipes import tiny_model_dir
from asyncgrpo.server.engine import Engine
from asyncgrpo.server.request import Request, RequestOutput, SamplingParams

PROMPTS = [[5, 6, 7], list(range(10, 30)), [9], [3] * 11]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(max_tokens=6 + 3 * i, temperature=0.9, seed=100 + i, logprobs=2, min_tokens=2)
    return SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, logprobs=2)


def _run(look_ahead: bool) -> tuple[dict[str, RequestOutput], dict[str, int]]:
    eng = Engine(tiny_model_dir("qwen3"), device="cpu", max_model_len=64, max_num_seqs=8)
    eng._core.look_ahead = look_ahead
    calls = {"ahead": 0, "sync": 0}
    launch = eng._core._launch

    def counting(batch, next_tokens=None):
        calls["ahead" if next_tokens is not None else "sync"] += 1
        return launch(batch, next_tokens)

    eng._core._launch = counting
    outs: dict[str, RequestOutput] = {}
    done = threading.Event()

    def cb(o: RequestOutput) -> None:
        outs[o.request_id] = o
        if len(outs) == len(PROMPTS):
            done.set()

    try:
        for i, p in enumerate(PROMPTS):  # submitted before the thread starts: one prefill, then pure decode
            eng.submit(Request(f"r{i}", p, _params(i)), cb)
        eng.start()
        assert done.wait(120), "requests did not finish"
    finally:
        eng.shutdown()
    return outs, calls


def test_look_ahead_equals_synchronous_steps():
    ahead, calls = _run(True)
    sync, sync_calls = _run(False)
    assert calls["ahead"] > 0 and sync_calls["ahead"] == 0
    assert sum(calls.values()) == sum(sync_calls.values())  # rows ending by length are not decoded ahead
    for rid, ref in sync.items():
        got = ahead[rid]
        assert got.token_ids == ref.token_ids and len(got.token_ids) == _params(int(rid[1:])).max_tokens
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        assert got.top_logprobs == [[(t, pytest.approx(v, abs=1e-5)) for t, v in row] for row in ref.top_logprobs]
        assert [(s.version, s.start, s.end) for s in got.weight_versions] == [("0", 0, len(ref.token_ids))]


def test_start_takes_the_startup_heap_out_of_gc_scans_and_shutdown_gives_it_back():
    """Engine.start freezes what exists (the model, graphs, tables), so full collections while decoding skip it."""
    import gc

    eng = Engine(tiny_model_dir("qwen3"), device="cpu", max_model_len=64, max_num_seqs=8)
    before = gc.get_freeze_count()  # 0 unless an earlier test in this process left an engine running
    eng.start()
    try:
        assert gc.get_freeze_count() > before + 1000  # the model's modules and tensors at least
    finally:
        eng.shutdown()
    assert gc.get_freeze_count() == 0

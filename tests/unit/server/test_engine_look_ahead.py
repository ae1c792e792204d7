"""Decoding one step ahead (the next step launched from the device-side tokens of the step in flight) gives the
same tokens, log-probs and weight-version spans as stepping synchronously, for greedy and seeded requests."""

from __future__ import annotations

import threading
import time

import pytest

from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request, RequestOutput, SamplingParams

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


def _wait(pred, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_requests_arriving_mid_decode_keep_the_engine_decoding_ahead():
    """A server fed by a rollout worker gets a request nearly every step. Queuing one must not end the step decoded
    ahead: with new requests arriving twice per step, most decode steps are still launched ahead, and the long
    request's tokens are those of a run without arrivals."""
    ref, _ = _run_one_long(arrivals=False)
    got, frac = _run_one_long(arrivals=True)
    assert got.token_ids == ref.token_ids and got.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    # Arrivals are admitted in batches (a prefill every 16 decode steps here), and the decode after a prefill
    # runs synchronously; everything else goes ahead. As commands, the arrivals held this near 0.
    assert frac > 0.5, f"only {frac:.0%} of the decode steps during arrivals went ahead"


def _run_one_long(arrivals: bool) -> tuple[RequestOutput, float]:
    eng = Engine(tiny_model_dir("qwen3"), device="cpu", max_model_len=256, max_num_seqs=256)
    outs: dict[str, RequestOutput] = {}
    eng.start()
    try:
        eng.submit(Request("long", [5, 6, 7], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)),
                   lambda o: outs.__setitem__(o.request_id, o))  # fmt: skip
        decode = lambda: eng.step_timings()["decode"]
        _wait(lambda: decode()["steps"] >= 5, "the long request's first decode steps")
        t0, s0 = time.perf_counter(), decode()["steps"]
        _wait(lambda: decode()["steps"] >= s0 + 10, "ten decode steps")
        step_s = (time.perf_counter() - t0) / max(decode()["steps"] - s0, 1)
        before = decode()
        if arrivals:
            for i in range(40):  # two per decode step
                eng.submit(Request(f"short{i}", [9, i + 1], SamplingParams(max_tokens=1, temperature=0.0)),
                           lambda o: outs.__setitem__(o.request_id, o))  # fmt: skip
                time.sleep(step_s / 2)
        else:
            time.sleep(40 * step_s / 2)
        after = decode()
        _wait(lambda: len(outs) == 1 + 40 * arrivals, "every request to finish")
    finally:
        eng.shutdown()
    steps = after["steps"] - before["steps"]
    return outs["long"], (after["steps_ahead"] - before["steps_ahead"]) / max(steps, 1)


def test_an_abort_right_after_its_submit_finds_the_request_while_a_step_is_in_flight():
    """Requests and other commands travel apart; a request is still known before a later command about it."""
    eng = Engine(tiny_model_dir("qwen3"), device="cpu", max_model_len=256, max_num_seqs=256)
    outs: dict[str, RequestOutput] = {}
    eng.start()
    try:
        keep = lambda o: outs.__setitem__(o.request_id, o)
        eng.submit(Request("long", [5, 6, 7], SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)), keep)
        _wait(lambda: eng.step_timings()["decode"]["steps"] >= 5, "decoding to start")
        for i in range(20):
            eng.submit(Request(f"gone{i}", [9, 8, 7], SamplingParams(max_tokens=100, ignore_eos=True)), keep)
            eng.abort(f"gone{i}")
        _wait(lambda: all(f"gone{i}" in outs for i in range(20)), "the aborted requests")
        assert {outs[f"gone{i}"].finish_reason for i in range(20)} == {"abort"}
        assert all(len(outs[f"gone{i}"].token_ids) < 100 for i in range(20))
        eng.abort("long")
        _wait(lambda: "long" in outs, "the long request")
    finally:
        eng.shutdown()

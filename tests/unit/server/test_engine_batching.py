"""Engine behaviour on CPU: continuous batching, stop rules, abort, pause modes, preemption.

References are computed in the test from the HF model itself: greedy tokens by
repeated full forwards (no cache), log-probs by log_softmax of HF logits.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncgrpo.assets import tiny_model, tiny_model_dir
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request, RequestOutput, SamplingParams
from tests.helpers.reference import hf_greedy

TIMEOUT = 120.0


class Collector:
    """on_finish target that records outputs and lets the test wait for them."""

    def __init__(self) -> None:
        self.outputs: dict[str, RequestOutput] = {}
        self.calls: dict[str, int] = {}
        self._cv = threading.Condition()

    def __call__(self, out: RequestOutput) -> None:
        with self._cv:
            self.outputs[out.request_id] = out
            self.calls[out.request_id] = self.calls.get(out.request_id, 0) + 1
            self._cv.notify_all()

    def wait(self, ids, timeout: float = TIMEOUT) -> dict[str, RequestOutput]:
        ids = list(ids)
        with self._cv:
            ok = self._cv.wait_for(lambda: all(i in self.outputs for i in ids), timeout=timeout)
        assert ok, f"timed out waiting for {[i for i in ids if i not in self.outputs]}"
        return {i: self.outputs[i] for i in ids}


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=kw.pop("ignore_eos", True), **kw)


PROMPTS = [[5, 17, 99, 3], list(range(100, 123)), [42], [7, 7, 7, 7, 7, 7, 7, 7, 7]]


@pytest.fixture(scope="module")
def model_dir():
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture
def engine(model_dir):
    eng = Engine(model_dir, max_model_len=96, max_num_seqs=8, kv_cache_tokens=2048, block_size=8)
    eng.start()
    yield eng
    eng.shutdown()


def test_concurrent_requests_and_a_late_joiner_match_hf_greedy(engine, hf):
    col = Collector()
    for i, p in enumerate(PROMPTS):
        engine.submit(Request(f"r{i}", p, greedy(12)), col)
    col.wait(["r0"])  # the batch is running; this one joins mid-run
    engine.submit(Request("late", [9, 8, 7, 6, 5], greedy(12)), col)
    outs = col.wait([f"r{i}" for i in range(len(PROMPTS))] + ["late"])
    for rid, prompt in [*((f"r{i}", p) for i, p in enumerate(PROMPTS)), ("late", [9, 8, 7, 6, 5])]:
        tokens, lps = hf_greedy(hf, prompt, 12)
        out = outs[rid]
        assert out.token_ids == tokens and out.finish_reason == "length" and out.stop_reason is None
        assert out.logprobs == pytest.approx(lps, abs=1e-4)
        assert out.prompt_token_ids == prompt
        assert [(s.version, s.start, s.end) for s in out.weight_versions] == [("0", 0, 12)]
    assert all(n == 1 for n in col.calls.values())
    assert engine.is_alive
    stats = engine.stats()
    assert stats.generation_tokens_total == 12 * 5 and stats.num_running == 0 and stats.kv_cache_usage == 0.0


def test_stop_token_ids_eos_min_tokens_and_length(model_dir, hf):
    prompt = PROMPTS[1]
    tokens, _ = hf_greedy(hf, prompt, 10)
    k = next(i for i in range(2, 10) if tokens[i] not in tokens[:i])  # first position where a new token appears
    stop_tok = tokens[k]
    # an engine whose EOS is that same token
    model = tiny_model("qwen3")
    model.config.eos_token_id = stop_tok
    model.generation_config.eos_token_id = stop_tok
    eng = Engine(model, max_model_len=40, kv_cache_tokens=512, block_size=8)
    eng.start()
    try:
        col = Collector()
        eng.submit(Request("stop_id", prompt, greedy(10, ignore_eos=True, stop_token_ids=[stop_tok])), col)
        eng.submit(Request("eos", prompt, greedy(10, ignore_eos=False)), col)
        eng.submit(Request("ignore", prompt, greedy(10, ignore_eos=True)), col)
        eng.submit(Request("min_tok", prompt, greedy(10, ignore_eos=False, min_tokens=k + 2)), col)
        eng.submit(Request("max_len", prompt, greedy(30, ignore_eos=True)), col)  # 23 + 30 > 40
        outs = col.wait(["stop_id", "eos", "ignore", "min_tok", "max_len"])
    finally:
        eng.shutdown()
    assert outs["stop_id"].token_ids == tokens[: k + 1]
    assert (outs["stop_id"].finish_reason, outs["stop_id"].stop_reason) == ("stop", stop_tok)
    assert outs["eos"].token_ids == tokens[: k + 1]
    assert (outs["eos"].finish_reason, outs["eos"].stop_reason) == ("stop", None)
    assert outs["ignore"].token_ids == tokens and outs["ignore"].finish_reason == "length"
    mt = outs["min_tok"].token_ids
    assert len(mt) >= k + 2 and stop_tok not in mt[: k + 2] and mt[:k] == tokens[:k]
    assert len(outs["max_len"].token_ids) == 40 - len(prompt) and outs["max_len"].finish_reason == "length"


def test_abort_keeps_partial_tokens(engine):
    col = Collector()
    engine.submit(Request("long", [1, 2, 3], greedy(90)), col)
    deadline = time.time() + TIMEOUT
    while engine.stats().generation_tokens_total < 3 and time.time() < deadline:
        time.sleep(0.01)
    engine.abort("long")
    out = col.wait(["long"])["long"]
    assert out.finish_reason == "abort" and 3 <= len(out.token_ids) < 90
    assert len(out.logprobs) == len(out.token_ids)
    engine.abort("no-such-request")  # ignored


def test_pause_keep_freezes_then_resumes_with_the_same_tokens(engine, hf):
    col = Collector()
    engine.submit(Request("a", PROMPTS[0], greedy(40)), col)
    while engine.stats().generation_tokens_total < 2:
        time.sleep(0.01)
    engine.pause("keep")
    assert engine.is_paused and engine.pause_mode == "keep"
    frozen = engine.stats().generation_tokens_total
    engine.submit(Request("queued", PROMPTS[2], greedy(5)), col)  # queues while paused
    time.sleep(0.3)
    assert engine.stats().generation_tokens_total == frozen and "a" not in col.outputs
    engine.resume()
    outs = col.wait(["a", "queued"])
    assert outs["a"].token_ids == hf_greedy(hf, PROMPTS[0], 40)[0]
    assert outs["queued"].finish_reason == "length"


def test_pause_wait_drains_running_and_keeps_waiting(engine):
    col = Collector()
    engine.submit(Request("run", PROMPTS[0], greedy(20)), col)
    while engine.stats().num_running == 0:
        time.sleep(0.01)
    engine.pause("wait", timeout=TIMEOUT)
    assert "run" in col.outputs and col.outputs["run"].finish_reason == "length"
    engine.submit(Request("later", PROMPTS[2], greedy(4)), col)
    time.sleep(0.2)
    assert "later" not in col.outputs and engine.stats().num_waiting == 1
    engine.resume()
    assert col.wait(["later"])["later"].finish_reason == "length"


def test_pause_abort_finishes_everything(engine):
    col = Collector()
    for i in range(3):
        engine.submit(Request(f"x{i}", PROMPTS[i], greedy(80)), col)
    while engine.stats().generation_tokens_total < 2:
        time.sleep(0.01)
    engine.pause("abort")
    outs = col.wait(["x0", "x1", "x2"], timeout=5)
    assert all(o.finish_reason == "abort" for o in outs.values())
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0
    engine.resume()
    assert not engine.is_paused


def test_preemption_by_recompute_keeps_greedy_outputs(model_dir, hf):
    # 64 KV tokens in blocks of 4; four sequences that each grow to 34 tokens cannot all fit
    eng = Engine(model_dir, max_model_len=64, kv_cache_tokens=64, block_size=4, max_num_seqs=4)
    eng.start()
    try:
        col = Collector()
        prompts = [PROMPTS[0], PROMPTS[3], [11, 12, 13, 14, 15, 16], [300, 301]]
        for i, p in enumerate(prompts):
            eng.submit(Request(f"p{i}", p, greedy(28)), col)
        outs = col.wait([f"p{i}" for i in range(4)])
        assert eng.stats().num_preemptions_total > 0
    finally:
        eng.shutdown()
    for i, p in enumerate(prompts):
        tokens, lps = hf_greedy(hf, p, 28)
        assert outs[f"p{i}"].token_ids == tokens
        assert outs[f"p{i}"].logprobs == pytest.approx(lps, abs=1e-4)


def test_submit_validation(engine):
    col = Collector()
    with pytest.raises(ValueError, match="max_model_len"):
        engine.submit(Request("long", list(range(96)), greedy(4)), col)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit(Request("oov", [engine.vocab_size], greedy(4)), col)
    with pytest.raises(ValueError, match="LoRA"):
        engine.submit(Request("lora", [1], greedy(4), lora_name="nope"), col)
    with pytest.raises(ValueError, match="top_p"):
        engine.submit(Request("tp", [1], SamplingParams(max_tokens=2, top_p=0.0)), col)
    engine.submit(Request("dup", [1], greedy(30)), col)
    with pytest.raises(ValueError, match="already in flight"):
        engine.submit(Request("dup", [1], greedy(30)), col)
    col.wait(["dup"])


def test_callback_errors_do_not_kill_the_engine(engine):
    def boom(out):
        raise RuntimeError("callback failure")

    engine.submit(Request("bad", [1, 2], greedy(3)), boom)
    col = Collector()
    engine.submit(Request("good", [1, 2], greedy(3)), col)
    assert col.wait(["good"])["good"].finish_reason == "length"


def test_seeded_sampling_is_reproducible_across_batches(engine):
    p = {"max_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 99, "ignore_eos": True}
    col = Collector()
    engine.submit(Request("alone", PROMPTS[1], SamplingParams(**p)), col)
    first = col.wait(["alone"])["alone"]
    for i in range(3):
        engine.submit(Request(f"noise{i}", PROMPTS[i], SamplingParams(max_tokens=10, temperature=1.0)), col)
    engine.submit(Request("crowd", PROMPTS[1], SamplingParams(**p)), col)
    second = col.wait(["crowd"])["crowd"]
    assert second.token_ids == first.token_ids
    assert second.logprobs == pytest.approx(first.logprobs, abs=1e-5)

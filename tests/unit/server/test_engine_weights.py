"""Weight updates through the engine: load_weights by HF name, tied embeddings, version spans."""

from __future__ import annotations

import time

import pytest
import torch

from asyncgrpo.assets import tiny_model
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request, SamplingParams
from tests.helpers.reference import hf_greedy
from tests.unit.server.test_engine_batching import Collector, greedy

PROMPT = [3, 14, 15, 92, 65]


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen3", True)])
def test_load_weights_switches_to_the_new_model(arch, tied):
    old = tiny_model(arch, seed=0, tie_word_embeddings=tied)
    new = tiny_model(arch, seed=1, tie_word_embeddings=tied)
    eng = Engine(tiny_model(arch, seed=0, tie_word_embeddings=tied), max_model_len=64, kv_cache_tokens=512)
    names = [n for n, _ in eng.named_parameters()]
    assert names == [n for n, _ in old.named_parameters()]
    assert ("lm_head.weight" in names) != tied
    eng.start()
    try:
        col = Collector()
        eng.submit(Request("before", PROMPT, greedy(8)), col)
        assert col.wait(["before"])["before"].token_ids == hf_greedy(old, PROMPT, 8)[0]
        state = dict(new.named_parameters())
        if tied:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # trainers may send it anyway
        eng.run_between_steps(lambda: eng.load_weights(state.items()))
        eng.set_weight_version("step-1")
        eng.submit(Request("after", PROMPT, greedy(8)), col)
        out = col.wait(["after"])["after"]
    finally:
        eng.shutdown()
    assert out.token_ids == hf_greedy(new, PROMPT, 8)[0]
    assert [(s.version, s.start, s.end) for s in out.weight_versions] == [("step-1", 0, 8)]


def test_unknown_or_misshaped_weights_raise_and_errors_reach_the_caller():
    eng = Engine(tiny_model("qwen2"), max_model_len=32, kv_cache_tokens=256)
    eng.start()
    try:
        with pytest.raises(ValueError, match="model.layers.0.nope"):
            eng.run_between_steps(lambda: eng.load_weights([("model.layers.0.nope", torch.zeros(1))]))
        with pytest.raises(ValueError, match="shape"):
            eng.run_between_steps(lambda: eng.load_weights([("model.norm.weight", torch.zeros(3))]))
        assert eng.run_between_steps(lambda: 41 + 1) == 42
    finally:
        eng.shutdown()


def test_version_spans_label_tokens_by_the_version_in_force():
    eng = Engine(tiny_model("llama"), max_model_len=96, kv_cache_tokens=512)
    eng.start()
    try:
        col = Collector()
        eng.submit(Request("r", PROMPT, greedy(60)), col)
        while eng.stats().generation_tokens_total < 5:
            time.sleep(0.005)
        eng.pause("keep")
        k = eng.stats().generation_tokens_total
        eng.run_between_steps(lambda: eng.set_weight_version("v1"))
        eng.resume()
        out = col.wait(["r"])["r"]
    finally:
        eng.shutdown()
    spans = [(s.version, s.start, s.end) for s in out.weight_versions]
    assert spans == [("0", 0, k), ("v1", k, 60)]
    assert eng.weight_version == "v1"


def test_sampled_logprobs_are_the_processed_distribution(tmp_path):
    """temperature 0.5 + top_k 10 through the engine: logprobs equal the truncated, tempered HF softmax."""
    hf = tiny_model("qwen3", seed=3)
    eng = Engine(tiny_model("qwen3", seed=3), max_model_len=64, kv_cache_tokens=512)
    eng.start()
    try:
        col = Collector()
        p = SamplingParams(max_tokens=6, temperature=0.5, top_k=10, seed=5, logprobs=3, ignore_eos=True)
        eng.submit(Request("s", PROMPT, p), col)
        out = col.wait(["s"])["s"]
    finally:
        eng.shutdown()
    ids = list(PROMPT)
    for i, tok in enumerate(out.token_ids):
        with torch.no_grad():
            x = hf(torch.tensor([ids])).logits[0, -1].double() / 0.5
        kth = x.topk(10).values[-1]
        x[x < kth] = float("-inf")
        ref = torch.log_softmax(x, dim=0)
        assert out.logprobs[i] == pytest.approx(float(ref[tok]), abs=1e-4)
        top_vals, top_ids = ref.topk(3)
        assert [t for t, _ in out.top_logprobs[i]] == top_ids.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(top_vals.tolist(), abs=1e-4)
        ids.append(tok)

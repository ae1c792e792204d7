"""The engine's general model path in process (CPU, fp32), on the tiny Gated DeltaNet hybrid (Qwen3.5 text) and
the tiny Qwen3-VL: preemption by recompute, abort, a keep-pause with cached state, weight loading under a VLM's
text-model names, and the LoRA refusal. References are plain HF forwards without a cache."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request, SamplingParams
from tests.helpers.reference import hf_model
from tests.unit.server.test_engine_batching import Collector, greedy


@torch.no_grad()
def _check(hf, prompt, out, tol=1e-4):
    """Greedy tokens and their log-probs equal one cache-free HF forward over prompt + output."""
    ids = list(prompt) + out.token_ids
    ref = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0, len(prompt) - 1 :].double(), -1)
    assert out.token_ids == ref.argmax(-1).tolist()
    assert out.logprobs == pytest.approx(ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist(), abs=tol)


@pytest.fixture(scope="module")
def hybrid_dir():
    return tiny_model_dir("qwen3_5")


def test_deltanet_hybrid_preemption_recomputes_state(hybrid_dir):
    """Too few KV blocks for four growing sequences: preempted ones restart their HF cache (conv and recurrent
    state included) from their tokens, and every output still equals the cache-free HF reference."""
    eng = Engine(hybrid_dir, max_model_len=24, kv_cache_tokens=24, block_size=2, max_num_seqs=4)
    assert eng.general_path and eng.decode_backend == "hf-general"
    eng.start()
    try:
        col = Collector()
        prompts = [[5, 17, 99, 3], [7] * 5, [11, 12, 13], [300, 301]]
        for i, p in enumerate(prompts):
            eng.submit(Request(f"p{i}", p, greedy(8)), col)
        outs = col.wait([f"p{i}" for i in range(4)])
        assert eng.stats().num_preemptions_total > 0
    finally:
        eng.shutdown()
    hf = hf_model(hybrid_dir)
    for i, p in enumerate(prompts):
        _check(hf, p, outs[f"p{i}"])


def test_abort_and_keep_pause_without_clearing(hybrid_dir):
    eng = Engine(hybrid_dir, max_model_len=32, max_num_seqs=2)
    eng.start()
    try:
        col = Collector()
        eng.submit(Request("long", [1, 2, 3], greedy(12)), col)
        eng.pause("keep", timeout=30, clear_cache=False)  # frozen mid-flight with its HF cache kept
        eng.submit(Request("gone", [4, 5], greedy(40)), col)
        eng.abort("gone")
        eng.resume()
        outs = col.wait(["long", "gone"])
    finally:
        eng.shutdown()
    assert outs["gone"].finish_reason == "abort"
    _check(hf_model(hybrid_dir), [1, 2, 3], outs["long"])


def test_vlm_loads_text_weights_under_either_name_and_refuses_lora():
    model_dir = tiny_model_dir("qwen3_vl")
    with pytest.raises(ValueError, match="--enable-lora is not supported"):
        Engine(model_dir, max_model_len=32, enable_lora=True)
    eng = Engine(model_dir, max_model_len=32, max_num_seqs=1)
    names = eng.parameter_shapes()
    assert "model.language_model.norm.weight" in names and "model.norm.weight" in names  # causal-LM alias
    assert "model.visual.patch_embed.proj.weight" in names
    eng.load_weights([("model.norm.weight", torch.full(names["model.norm.weight"], 2.0))])
    hf = hf_model(model_dir)
    with torch.no_grad():
        hf.model.language_model.norm.weight.fill_(2.0)
    eng.start()
    try:
        col = Collector()
        eng.submit(Request("r", [1, 504, 3032], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)), col)
        out = col.wait(["r"])["r"]
    finally:
        eng.shutdown()
    _check(hf, [1, 504, 3032], out)


def test_group_of_one_prompt_decodes_as_one_batch(hybrid_dir):
    """A GRPO group (one prompt sampled several times, arriving together) prefills and decodes as one batch; rows
    whose sequence finished early keep decoding a filler until the last one is done, without disturbing the
    others. Every sampled token's log-prob equals the cache-free HF forward (temperature 1: raw log-probs)."""
    hf = hf_model(hybrid_dir)
    shapes: list[tuple[int, int]] = []
    hook = hf.register_forward_pre_hook(
        lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    eng = Engine(hf, max_model_len=48, max_num_seqs=8)
    eng.start()
    prompt = [1, 504, 3032, 314]
    lengths = [10, 3, 10, 6]
    try:
        col = Collector()
        for i, n in enumerate(lengths):
            eng.submit(Request(f"g{i}", prompt, SamplingParams(max_tokens=n, temperature=1.0, seed=i)), col)
        outs = col.wait([f"g{i}" for i in range(len(lengths))])
        assert eng.run_between_steps(lambda: eng._runner.num_cohorts, timeout=30) == 0  # caches freed at finish
    finally:
        eng.shutdown()
        hook.remove()
    assert shapes[0] == (4, len(prompt))  # one prefill for the group
    assert all(s == (4, 1) for s in shapes[1:]) and len(shapes) == max(lengths)  # one decode forward per step
    for i, n in enumerate(lengths):
        assert len(outs[f"g{i}"].token_ids) == n
        _check_sampled(hf, prompt, outs[f"g{i}"])
    assert len({tuple(outs[f"g{i}"].token_ids[:3]) for i in range(4)}) > 1  # the seeds differ


@torch.no_grad()
def _check_sampled(hf, prompt, out, tol=1e-4):
    ids = list(prompt) + out.token_ids
    ref = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0, len(prompt) - 1 :].double(), -1)
    want = ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0].tolist()
    assert out.logprobs == pytest.approx(want, abs=tol)


def test_qwen3_5_vision_language_checkpoint_serves_text():
    """The reference's quick-start family: a Qwen3.5 checkpoint with a vision tower (DeltaNet hybrid text model)."""
    model_dir = tiny_model_dir("qwen3_5_vlm")
    hf = hf_model(model_dir)
    assert type(hf).__name__ == "Qwen3_5ForConditionalGeneration"
    eng = Engine(model_dir, max_model_len=32, max_num_seqs=2)
    eng.start()
    try:
        col = Collector()
        eng.submit(Request("a", [1, 504, 3032], SamplingParams(max_tokens=6, temperature=1.0, seed=3)), col)
        eng.submit(Request("b", [1, 504, 3032], greedy(6)), col)
        outs = col.wait(["a", "b"])
    finally:
        eng.shutdown()
    _check_sampled(hf, [1, 504, 3032], outs["a"])
    _check(hf, [1, 504, 3032], outs["b"])

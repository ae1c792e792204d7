"""CUDA graphs of the step (trainer/graphed_step.py), the parts that hold on any device: the buckets, the rule
that turns the graphs on, and the padding the graphs rely on (a padded row's real tokens see exactly what the
unpadded row's see, forward and backward). The capture itself: tests/gpu/test_graphed_step_gpu.py."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncgrpo.assets import tiny_model
from asyncgrpo.packing.attention import packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.trainer import graphed_step
from asyncgrpo.trainer.graphed_step import AUTO_TOKEN_PARAMS, GraphedDecoder, _Bucket, graph_buckets, wants_graphed_step


def test_buckets_are_quarters_of_the_budget_in_whole_blocks():
    assert graph_buckets(1024) == [256, 512, 768, 1024]
    assert graph_buckets(1000) == [256, 512, 768, 1024]  # 250, 500, 750, 1000 rounded up to 128
    assert graph_buckets(4096) == [1024, 2048, 3072, 4096]
    assert graph_buckets(100) == [128]  # every quarter fits one block


def _args(**kw):
    base = {"cuda_graph_step": None, "device": "cuda", "world_size": 1}
    return SimpleNamespace(**{**base, **kw})


def test_auto_rule(monkeypatch):
    model = tiny_model("llama")
    params = sum(p.numel() for p in model.parameters())
    fits = int(AUTO_TOKEN_PARAMS // params)
    monkeypatch.setattr(graphed_step, "have_triton", lambda: True)
    assert wants_graphed_step(_args(), model, False, None, False, fits)
    assert not wants_graphed_step(_args(), model, False, None, False, fits + 1)  # too large a step: eager
    assert not wants_graphed_step(_args(world_size=2), model, False, None, False, 256)
    assert not wants_graphed_step(_args(), model, True, None, False, 256)  # PEFT
    assert not wants_graphed_step(_args(), model, False, object(), False, 256)  # routing replay
    assert not wants_graphed_step(_args(), model, False, None, True, 256)  # router loss
    assert not wants_graphed_step(_args(device="cpu"), model, False, None, False, 256)
    assert not wants_graphed_step(_args(cuda_graph_step=False), model, False, None, False, 256)
    assert wants_graphed_step(_args(cuda_graph_step=True), model, False, None, False, 10**9)  # forced: no size rule
    with pytest.raises(ValueError, match="cuda_graph_step=True needs a CUDA device"):
        wants_graphed_step(_args(cuda_graph_step=True, device="cpu"), model, False, None, False, 256)


def _row(seed: int):
    """Two prompts, three completions each (shared prefixes, so the tree has branches)."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(2):
        prompt = rng.integers(3, 200, 9).tolist()
        for _ in range(3):
            n = int(rng.integers(4, 12))
            samples.append(PackSample(prompt + rng.integers(3, 200, n).tolist(), [0] * 9 + [1] * n,
                                      [-1.0] * (9 + n), 1.0, g))  # fmt: skip
    return pack_samples(samples)


@pytest.mark.parametrize(("arch", "seed"), [("llama", 0), ("llama", 1), ("qwen2", 0), ("qwen3", 0), ("qwen3_vl", 0)])
def test_a_padded_row_keeps_its_tokens_hidden_states_and_gradients(arch, seed):
    torch.manual_seed(0)
    model = tiny_model(arch).float().train()
    use_tree_attention(model)
    row = _row(seed)
    graphs = GraphedDecoder(model, token_budget=4 * 128, autocast_dtype=None)
    graphs.backend = "sdpa"  # the dense mask: the same tree as FlexAttention's blocks, on the CPU
    bucket = _Bucket.empty(128, torch.device("cpu"))
    bucket.load(_row(seed + 7))  # stale contents from another row first: load must overwrite all of them
    bucket.load(row)
    n = row.num_tokens
    assert 0 < n < 128 and torch.equal(bucket.ids[:n], row.input_ids) and not bucket.ids[n:].any()
    assert torch.equal(bucket.end[n:], torch.arange(n + 1, 129))  # a pad sees itself only
    hidden_size = model.config.get_text_config().hidden_size
    weights = torch.randn(n, hidden_size, generator=torch.Generator().manual_seed(seed))

    def run(hidden_fn):
        model.zero_grad(set_to_none=True)
        hidden = hidden_fn()
        (hidden * weights).sum().backward()
        return hidden.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    ref_h, ref_g = run(lambda: packed_hidden_states(model, row))
    pad_h, pad_g = run(lambda: graphs._decoder_out(bucket.ids, bucket.pos, bucket.end)[:n])
    torch.testing.assert_close(pad_h, ref_h, rtol=1e-5, atol=1e-5)
    assert pad_g.keys() == ref_g.keys()
    for name, grad in pad_g.items():
        scale = float(ref_g[name].abs().max())  # fp32 sums in another order: rounding relative to the largest entry
        torch.testing.assert_close(
            grad, ref_g[name], rtol=1e-5, atol=1e-6 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )

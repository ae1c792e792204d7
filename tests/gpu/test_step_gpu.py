"""The fast packed step on CUDA: regional torch.compile (inductor) and the fused LM-head loss against the eager,
recomputing path on the same rows (fp32: 1e-4), with both tree backends that run compiled kernels.

Run: ``pytest -s -q -m gpu tests/gpu/test_step_gpu.py`` (one GPU, about a minute: the compile dominates).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncgrpo.packing.attention import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.trainer.compile import compile_decoder_layers, compile_for_training, uncompile_decoder_layers
from asyncgrpo.trainer.packed_loss import PolicyLossSettings, packed_policy_loss
from tests.gpu.test_packing_gpu import _model, _samples

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _with_top_n(samples, k=4, seed=0):
    rng = np.random.default_rng(seed)
    for s in samples:
        s.sampler_topn_ids = rng.integers(0, 1024, size=(len(s), k))
        s.sampler_topn_logprobs = np.full((len(s), k), -2.0, dtype=np.float32)
    return samples


def _step(model, row, backend, fused):
    model.zero_grad(set_to_none=True)
    hidden = packed_hidden_states(model, row, build_plan(row, backend))
    out = packed_policy_loss(hidden[row.pred_index], model.get_output_embeddings().weight, row, row.num_trained,
                             PolicyLossSettings(fused_lm_head=fused))  # fmt: skip
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_compiled_fused_step_matches_eager_recomputing_step(backend):
    model = _model("qwen3", torch.float32).train()
    use_tree_attention(model)
    rows = [pack_samples(_with_top_n(_samples(seed))).to("cuda") for seed in (0, 1)]  # two lengths
    ref = [_step(model, row, backend, fused=False) for row in rows]
    torch._dynamo.reset()
    compile_decoder_layers(model)
    try:
        for row, (ref_loss, ref_grads) in zip(rows, ref):
            loss, grads = _step(model, row, backend, fused=True)
            assert abs(loss.item() - ref_loss.item()) <= 1e-4
            assert grads.keys() == ref_grads.keys()
            worst = max(((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-8)).item()
                        for n, g in grads.items())  # fmt: skip
            print(f"\n{backend}: compiled+fused vs eager+recompute: loss diff {abs(loss.item() - ref_loss.item()):.2e}"
                  f", worst relative grad diff {worst:.2e}")  # fmt: skip
            assert worst <= 1e-3
        assert all(layer._compiled_call_impl is not None for layer in model.model.layers)  # no eager fallback
    finally:
        uncompile_decoder_layers(model)


def test_an_activation_budget_through_the_trainer_compile_matches_the_eager_step():
    """``activation_memory_budget`` as the trainer applies it: inductor's partitioner under the budget, transformers'
    checkpointing turned off on the args, the same loss and gradients as the eager recomputing step."""
    model = _model("qwen3", torch.float32).train()
    use_tree_attention(model)
    row = pack_samples(_with_top_n(_samples(0))).to("cuda")
    ref_loss, ref_grads = _step(model, row, "flex", fused=False)
    args = SimpleNamespace(activation_memory_budget=0.5, compile_decoder_layers=True, device="cuda", world_size=1,
                           gradient_checkpointing=True, activation_checkpointing=True)  # fmt: skip
    torch._dynamo.reset()
    assert compile_for_training(model, args, peft=False, router_replay=None) == len(model.model.layers)
    try:
        assert args.gradient_checkpointing is False and args.activation_checkpointing is False
        loss, grads = _step(model, row, "flex", fused=True)
        assert abs(loss.item() - ref_loss.item()) <= 1e-4
        assert grads.keys() == ref_grads.keys()
        worst = max(((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-8)).item()
                    for n, g in grads.items())  # fmt: skip
        print(f"\nbudget 0.5: compiled+fused vs eager+recompute: worst relative grad diff {worst:.2e}")
        assert worst <= 1e-3
        assert all(layer._compiled_call_impl is not None for layer in model.model.layers)  # no eager fallback
    finally:
        uncompile_decoder_layers(model)


def test_the_pass_clock_reads_the_forward_from_cuda_events():
    """One sync, after the backward: the forward's share from two events, within the whole, and about the length of
    the kernels queued between them (a 4096-square matmul chain, timed alone here for reference)."""
    from asyncgrpo.trainer.step_stats import PassClock

    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):  # cuBLAS set-up out of the way
        a @ a
    torch.cuda.synchronize()
    clock = PassClock("cuda")
    for _ in range(20):
        a @ a
    clock.forward_done()
    for _ in range(40):
        a @ a
    total, forward = clock.finish()
    assert 0 < forward < total
    assert 0.2 < forward / total < 0.5  # 20 of 60 equal matmuls

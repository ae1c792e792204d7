"""The cuDNN tree backend's split (own tokens causal + ancestors' tokens unmasked, merged by log-sum-exp) on CPU.

cuDNN runs only on CUDA, so its two entry points are replaced by a reference written out here with cuDNN's
semantics as torch exposes them: ragged sequences, causal aligned to the *top left*, a [H, T] (or [T, H, 1])
log-sum-exp, and a backward that takes the output and log-sum-exp it is given. The library never hands it a
sequence without keys (a root segment's run has a placeholder key, which must change nothing). Everything else is the library's: the plan,
the gather, the merge and the backward, checked against SDPA with the dense tree mask and autograd.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncgrpo.packing import attention, cudnn_tree
from asyncgrpo.packing.attention import TreeAttentionPlan, build_plan
from asyncgrpo.packing.row import pack_samples
from tests.helpers.synthetic import grpo_samples, random_tree_samples

HEADS, KV_HEADS, DIM = 4, 2, 8


def _scores(q, k, cu_q, cu_k, s, causal, scale):
    qs, ks = q[cu_q[s] : cu_q[s + 1]].float(), k[cu_k[s] : cu_k[s + 1]].float()
    ks = ks.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
    if causal:  # top left: query i sees keys 0..i
        scores = scores.masked_fill(torch.arange(len(ks))[None, :] > torch.arange(len(qs))[:, None], float("-inf"))
    return scores, ks


def _fake_forward(layout):
    def forward(q, k, v, bias, cu_q, cu_k, max_q, max_k, want_lse, dropout, causal, debug, scale):
        out = torch.full_like(q, float("nan"))
        lse = torch.full((q.shape[1], q.shape[0]), float("nan"))
        for s in range(len(cu_q) - 1):
            assert cu_k[s + 1] > cu_k[s], "a sequence without keys"
            scores, _ = _scores(q, k, cu_q, cu_k, s, causal, scale)
            vs = v[cu_k[s] : cu_k[s + 1]].float().repeat_interleave(q.shape[1] // v.shape[1], 1)
            out[cu_q[s] : cu_q[s + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs).to(q.dtype)
            lse[:, cu_q[s] : cu_q[s + 1]] = scores.logsumexp(-1)
        lse = lse if layout == "ht" else lse.t().contiguous().unsqueeze(-1)
        return out, lse, cu_q, cu_k, max_q, max_k, None, None, None

    return forward


def _fake_backward(layout):
    def backward(dout, q, k, v, out, lse, seed, offset, bias, cu_q, cu_k, max_q, max_k, dropout, causal, scale):
        lse = lse if layout == "ht" else lse[..., 0].t()
        assert lse.shape == (q.shape[1], q.shape[0])
        dq, dk, dv = torch.full_like(q, float("nan")), torch.zeros_like(k), torch.zeros_like(v)
        rep = q.shape[1] // k.shape[1]
        for s in range(len(cu_q) - 1):
            rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
            assert cu_k[s + 1] > cu_k[s], "a sequence without keys"
            scores, ks = _scores(q, k, cu_q, cu_k, s, causal, scale)
            p = torch.exp(scores - lse[:, rows, None])  # normalised by the lse it is given (the merged one)
            do, o = dout[rows].float(), out[rows].float()
            vs = v[keys].float().repeat_interleave(rep, 1)
            dvs = torch.einsum("hqk,qhd->khd", p, do)
            ds = p * (torch.einsum("qhd,khd->hqk", do, vs) - (do * o).sum(-1).t()[:, :, None])
            dq[rows] = (torch.einsum("hqk,khd->qhd", ds, ks) * scale).to(q.dtype)
            dks = torch.einsum("hqk,qhd->khd", ds, q[rows].float()) * scale
            dk[keys] = dks.unflatten(1, (k.shape[1], rep)).sum(2).to(k.dtype)
            dv[keys] = dvs.unflatten(1, (v.shape[1], rep)).sum(2).to(v.dtype)
        return dq, dk, dv

    return backward


@pytest.fixture(params=["ht", "th1"])
def fake_cudnn(request, monkeypatch):
    monkeypatch.setattr(cudnn_tree, "_cudnn_forward", _fake_forward(request.param))
    monkeypatch.setattr(cudnn_tree, "_cudnn_backward", _fake_backward(request.param))


def _rows():
    tree = pack_samples(random_tree_samples(np.random.default_rng(5), vocab_size=61, num_groups=3))
    groups = pack_samples(grpo_samples(3, 4, 7, (2, 6), vocab_size=61, seed=2))
    flat = pack_samples(grpo_samples(2, 3, 5, (1, 4), vocab_size=61, seed=3), share_prefixes=False)
    return {"multi-level tree": tree, "GRPO groups": groups, "flat": flat}


def _qkv(tokens: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, h, DIM, generator=g, dtype=torch.float64) for h in (HEADS, KV_HEADS, KV_HEADS)]


@pytest.mark.parametrize("name", ["multi-level tree", "GRPO groups", "flat"])
def test_split_attention_and_its_gradients_match_the_dense_tree_mask(fake_cudnn, name):
    row = _rows()[name]
    plan = cudnn_tree.build_cudnn_plan(row, torch.device("cpu"))
    assert (plan.cu_run_q is None) == (name == "flat")
    mask = build_plan(row, "sdpa").dense_mask
    leaves = [t.requires_grad_() for t in _qkv(row.num_tokens, 0)]
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    dout = torch.randn(row.num_tokens, HEADS, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    out = cudnn_tree.cudnn_tree_attention(*leaves, plan, None)
    out.backward(dout)
    q, k, v = (t.transpose(0, 1) for t in ref_leaves)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(0, 1)
    want.backward(dout)
    assert torch.allclose(out, want, atol=1e-5)  # the merge weighs in fp32, as on the GPU
    for got, ref in zip(leaves, ref_leaves):
        assert torch.allclose(got.grad, ref.grad, atol=1e-5)


def test_siblings_share_one_run_and_their_prompt_is_gathered_once():
    samples = grpo_samples(2, 5, 6, (2, 4), vocab_size=61, seed=4)
    row = pack_samples(samples)
    plan = cudnn_tree.build_cudnn_plan(row, torch.device("cpu"))
    starts, ends, parents = row.seg_start.tolist(), row.seg_end.tolist(), row.seg_parent.tolist()
    roots = [s for s, p in enumerate(parents) if p < 0]
    assert len(roots) == 2 and parents.count(roots[0]) == parents.count(roots[1]) == 5
    prompt = [ends[r] - starts[r] for r in roots]
    # runs: prompt 0 (a placeholder key), its 5 completions (keys: prompt 0), prompt 1, its completions
    assert (plan.cu_run_k[1:] - plan.cu_run_k[:-1]).tolist() == [1, prompt[0], 1, prompt[1]]
    assert (plan.cu_run_q[1:] - plan.cu_run_q[:-1]).tolist()[::2] == prompt
    assert plan.ancestors_index.numel() == sum(prompt) + 2  # each prompt gathered once, not once per completion
    assert plan.ancestors_index[plan.cu_run_k[2]].item() == starts[roots[1]]  # the placeholder: the root's 1st token
    assert int(plan.has_ancestors.sum()) == row.num_tokens - sum(prompt)
    assert plan.max_own == int((row.seg_end - row.seg_start).max())


def test_the_backend_runs_in_the_autocast_dtype_through_the_attention_function(fake_cudnn):
    row = _rows()["GRPO groups"]
    plan = TreeAttentionPlan("cudnn", row.num_tokens, cudnn=cudnn_tree.build_cudnn_plan(row, torch.device("cpu")))
    q, k, v = (t.float().transpose(0, 1)[None] for t in _qkv(row.num_tokens, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.tree_attention_forward(torch.nn.Module(), q, k, v, None, tree_plan=plan)
    assert out.dtype == torch.bfloat16 and out.shape == (1, row.num_tokens, HEADS, DIM)
    mask = build_plan(row, "sdpa").dense_mask
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(out.float(), want.transpose(1, 2), atol=3e-2)
    with pytest.raises(TypeError, match="'cudnn' needs bf16/fp16"):
        attention.tree_attention_forward(torch.nn.Module(), q, k, v, None, tree_plan=plan)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_plan(row, "cudnn", device="cpu")


def test_the_custom_ops_trace_inside_a_compiled_function(fake_cudnn):
    """The trainer compiles its decoder layers: the two ops must trace (their fakes agree with them) and run."""
    row = _rows()["multi-level tree"]
    plan = cudnn_tree.build_cudnn_plan(row, torch.device("cpu"))
    leaves = [t.requires_grad_() for t in _qkv(row.num_tokens, 3)]
    compiled = torch.compile(lambda q, k, v: cudnn_tree.cudnn_tree_attention(q, k, v, plan, None) * 2,
                             backend="aot_eager", fullgraph=True)  # fmt: skip
    compiled(*leaves).sum().backward()
    eager = [t.detach().clone().requires_grad_() for t in leaves]
    (cudnn_tree.cudnn_tree_attention(*eager, plan, None) * 2).sum().backward()
    for got, ref in zip(leaves, eager):
        assert torch.allclose(got.grad, ref.grad, atol=1e-12)

"""Tree packing on CUDA (SPEC P1, P5, B3): every backend against unpacked HF forwards, fp32 and bf16.

Run: ``ASYNCGRPO_GPU_REPORT=$OUT/packing_gpu.jsonl pytest -s -q tests/gpu/test_packing_gpu.py``; each
parity case prints (and appends to the report) the mean/max difference of log-probs and gradients.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from asyncgrpo.packing.attention import build_plan, packed_hidden_states, tree_attention_forward, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.trainer.logprobs import selective_logprobs
from tests.helpers.synthetic import grpo_samples, random_tree_samples

pytestmark = pytest.mark.gpu
VOCAB = 1024


def _report(record: dict) -> None:
    print("PARITY", json.dumps(record))
    path = os.environ.get("ASYNCGRPO_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _model(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    common = {
        "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
    }  # fmt: skip
    cfg = Qwen3Config(head_dim=32, **common) if arch == "qwen3" else LlamaConfig(**common)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")


def _samples(seed: int = 0):
    """Small tricky tries plus GRPO groups long enough to span many 128-token blocks."""
    rng = np.random.default_rng(seed)
    tricky = random_tree_samples(rng, vocab_size=VOCAB, num_groups=3)
    groups = grpo_samples(2, 4, prompt_len=300, completion_len=(40, 400), vocab_size=VOCAB, seed=seed, system_len=60)
    for s in groups:
        s.group_id = ("grpo", s.group_id)
    return tricky + groups


def _run(model, samples, backend, weights):
    """(packed log-probs, packed grads, reference log-probs, reference grads)."""
    head = lambda: model.get_output_embeddings().weight
    model.set_attn_implementation("sdpa")
    model.zero_grad()
    ref, start = [], 0
    for s in samples:
        ids = torch.from_numpy(s.token_ids).cuda()
        t = torch.from_numpy(np.flatnonzero(s.loss_mask)).cuda()
        hidden = model.base_model(input_ids=ids[None]).last_hidden_state[0]
        lp = selective_logprobs(hidden[t - 1], head(), ids[t]).logprobs
        (lp * weights[start : start + len(t)]).sum().backward()
        ref.append(lp.detach())
        start += len(t)
    ref_grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    row = pack_samples(samples).to("cuda")
    use_tree_attention(model)
    model.zero_grad()
    hidden = packed_hidden_states(model, row, build_plan(row, backend))
    lp = selective_logprobs(hidden[row.pred_index], head(), row.target_ids).logprobs
    (lp * weights).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    return lp.detach(), grads, torch.cat(ref), ref_grads


CASES = [
    ("qwen3", torch.float32, "flex", False),
    ("llama", torch.float32, "flex", True),
    ("qwen3", torch.float32, "sdpa", False),
    ("qwen3", torch.bfloat16, "flex", False),
    ("qwen3", torch.bfloat16, "varlen", True),
    ("llama", torch.bfloat16, "varlen", False),
    ("qwen3", torch.bfloat16, "sdpa", False),
]


@pytest.mark.parametrize(("arch", "dtype", "backend", "checkpointing"), CASES)
def test_packed_matches_unpacked_on_gpu(arch, dtype, backend, checkpointing):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(arch, dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    samples = _samples()
    n_trained = sum(s.num_trained for s in samples)
    weights = torch.randn(n_trained, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) / n_trained
    lp, grads, ref, ref_grads = _run(model, samples, backend, weights)
    d_lp = (lp - ref).abs()
    d_grad = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
    scale = max(ref_grads[n].abs().max().item() for n in grads)
    record = {
        "arch": arch, "dtype": str(dtype).removeprefix("torch."), "backend": backend,
        "checkpointing": checkpointing, "trained_tokens": n_trained,
        "logprob_mean_abs_diff": d_lp.mean().item(), "logprob_max_abs_diff": d_lp.max().item(),
        "grad_max_abs_diff": d_grad, "grad_max_abs": scale,
    }  # fmt: skip
    _report(record)
    if dtype == torch.float32:
        assert d_lp.max().item() <= 1e-4
        assert d_grad <= 1e-4
    else:  # bf16: different kernels round differently; report, and only catch gross errors
        assert d_lp.mean().item() <= 0.05 and d_lp.max().item() <= 1.0
        assert d_grad <= 0.1 * scale


def test_backends_agree_on_a_bench_sized_row():
    """Attention alone, bf16, a G=8 group of ~8k tokens: flex and varlen vs the dense-mask reference."""
    samples = grpo_samples(1, 8, prompt_len=512, completion_len=(128, 1536), vocab_size=VOCAB, seed=1)
    row = pack_samples(samples).to("cuda")
    total = row.num_tokens
    g = torch.Generator("cuda").manual_seed(0)
    q0 = torch.randn(1, 16, total, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k0 = torch.randn(1, 8, total, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v0 = torch.randn(1, 8, total, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    go = torch.randn(1, total, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    outs = {}
    for backend in ("sdpa", "flex", "varlen"):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out, _ = tree_attention_forward(torch.nn.Module(), q, k, v, None, scaling=128**-0.5,
                                        tree_plan=build_plan(row, backend))  # fmt: skip
        out.backward(go)
        outs[backend] = (out.float(), q.grad.float(), k.grad.float(), v.grad.float())
    for backend in ("flex", "varlen"):
        # bf16 kernels differ in rounding: compare relative to each tensor's largest reference entry
        rel = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(outs[backend], outs["sdpa"])]
        _report({"attention_only": backend, "tokens": total, "out_dq_dk_dv_rel_max_diff": rel})
        assert max(rel) <= 0.02


def test_logprobs_peak_memory_bounded_on_cuda():
    """Qwen3 vocabulary: extra memory of log-probs + entropy + top-8, fwd+bwd, as tokens grow 16x."""
    vocab, hid = 151_936, 1024
    w = torch.randn(vocab, hid, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    extra_bytes = []
    for n in (2048, 8192, 32768):
        h = torch.randn(n, hid, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        t = torch.randint(0, vocab, (n,), device="cuda")
        ex = torch.randint(0, vocab, (n, 8), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        o = selective_logprobs(h, w, t, extra_ids=ex, want_entropy=True)
        (o.logprobs.sum() + o.extra_logprobs.sum() + o.entropy.sum()).backward()
        torch.cuda.synchronize()
        extra_bytes.append(torch.cuda.max_memory_allocated() - base)
        w.grad = None
        del h, o
    full = [n * vocab * 4 for n in (2048, 8192, 32768)]
    _report(
        {"logprob_peak_extra_gib": [b / 2**30 for b in extra_bytes], "full_fp32_logits_gib": [f / 2**30 for f in full]}
    )
    assert max(extra_bytes) < 4 * 2**30  # a [32768, 151936] fp32 tensor alone is 18.5 GiB
    assert extra_bytes[-1] - extra_bytes[0] < 2**30


def _timed(fn) -> float:
    """Milliseconds per call of ``fn`` (CUDA events over 20 calls, after 3)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


def test_the_varlen_gather_backward_sums_copies_like_index_add_and_says_how_fast():
    """A G=16 group with a 2,048-token prompt (bench shape): the K/V-gradient sum over each token's path copies
    against an fp32 ``index_add``; prints both kernels' times (CUDA events) for bench/LOG.md."""
    from asyncgrpo.packing.attention import _varlen_plan
    from asyncgrpo.packing.path_gather import path_gather_backward

    samples = grpo_samples(1, 16, prompt_len=2048, completion_len=(256, 1024), vocab_size=VOCAB, seed=2)
    row = pack_samples(samples)
    plan = _varlen_plan(row, torch.device("cuda"))
    g = torch.Generator("cuda").manual_seed(0)
    grad = torch.randn(plan.kv_index.numel(), 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    want = torch.zeros(row.num_tokens, 8, 128, device="cuda").index_add_(0, plan.kv_index, grad.float())
    got = path_gather_backward(grad, plan.kv_index, plan.kv_order, plan.kv_offsets)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).abs().max() / want.abs().max()).item() <= 1e-2

    ours = _timed(lambda: path_gather_backward(grad, plan.kv_index, plan.kv_order, plan.kv_offsets))
    atomics = _timed(lambda: torch.zeros(row.num_tokens, 8, 128, device="cuda", dtype=torch.bfloat16)
                    .index_add_(0, plan.kv_index, grad))  # fmt: skip
    _report({"varlen_kv_grad_sum_ms": ours, "bf16_index_add_ms": atomics, "paths_rows": plan.kv_index.numel(),
             "tokens": row.num_tokens})  # fmt: skip


def test_the_widened_gather_sums_heads_and_copies_in_one_pass_and_says_how_fast():
    """K/V widened to 16 query heads from 8 (Qwen3-1.7B's GQA), G=16 bench row: the one-pass sum over copies and
    heads against fp32 ``index_add`` of the head sums; timed against what it replaces, torch's strided head sum (as
    FlashAttention's GQA backward runs it) followed by the copy sum."""
    from asyncgrpo.packing.attention import _varlen_plan
    from asyncgrpo.packing.path_gather import path_gather, path_gather_backward

    samples = grpo_samples(1, 16, prompt_len=2048, completion_len=(256, 1024), vocab_size=VOCAB, seed=2)
    row = pack_samples(samples)
    plan = _varlen_plan(row, torch.device("cuda"))
    gather = (plan.kv_index, plan.kv_order, plan.kv_offsets)
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(8, row.num_tokens, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(0, 1)
    assert torch.equal(path_gather(x, *gather, 2), x[plan.kv_index].repeat_interleave(2, dim=1))
    grad = torch.randn(plan.kv_index.numel(), 16, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    heads = grad.float().unflatten(1, (8, 2)).sum(2)
    want = torch.zeros(row.num_tokens, 8, 128, device="cuda").index_add_(0, plan.kv_index, heads)
    got = path_gather_backward(grad, *gather, 2)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert ((got.float() - want).abs().max() / want.abs().max()).item() <= 1e-2

    one_pass = _timed(lambda: path_gather_backward(grad, *gather, 2))
    two_pass = _timed(lambda: path_gather_backward(grad.unflatten(1, (8, 2)).sum(2), *gather))
    widened = _timed(lambda: path_gather(x, *gather, 2))
    expanded_view = _timed(lambda: x.unsqueeze(2).expand(-1, 8, 2, 128).index_select(0, plan.kv_index))
    _report({"widened_kv_grad_sum_ms": one_pass, "head_sum_then_copy_sum_ms": two_pass,
             "widened_gather_ms": widened, "expanded_view_index_select_ms": expanded_view,
             "paths_rows": plan.kv_index.numel(), "tokens": row.num_tokens})  # fmt: skip
    assert one_pass < two_pass and widened < expanded_view

"""Tree attention parity (SPEC P1, B3 on CPU): packed forward/backward == each sample forwarded alone by HF.

The packed side runs what the trainer runs: tree attention + the chunked log-prob module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from asyncgrpo.packing.attention import build_plan, flex_block_mask, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.trainer.logprobs import selective_logprobs
from tests.helpers.reference import lora_model, unpacked_logprobs_and_grads
from tests.helpers.synthetic import random_tree_samples

VOCAB = 97
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _model(arch: str) -> torch.nn.Module:
    cfg = {
        "llama": lambda: LlamaConfig(**COMMON),
        "qwen2": lambda: Qwen2Config(**COMMON),
        "qwen3": lambda: Qwen3Config(head_dim=8, **COMMON),
    }[arch]()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")


def _reference(model, samples, weights):
    """Per-sample unpacked HF forward (sdpa): trained-token log-probs and grads of sum(weights * logp)."""
    model.set_attn_implementation("sdpa")
    return unpacked_logprobs_and_grads(model, samples, weights)


def _packed(model, row, weights):
    use_tree_attention(model)
    model.zero_grad()
    hidden = packed_hidden_states(model, row, build_plan(row, "sdpa"))
    head = model.get_output_embeddings().weight
    lp = selective_logprobs(hidden[row.pred_index], head, row.target_ids, chunk_size=16).logprobs
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_matches_unpacked(arch, checkpointing):
    rng = np.random.default_rng(7)
    samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=3)
    row = pack_samples(samples)
    assert row.num_tokens < row.num_flat_tokens  # sharing happened
    model = _model(arch)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # checkpointing is active only in training mode (dropout is 0 in these configs)
        assert all(layer.gradient_checkpointing for layer in model.base_model.layers)
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_grads = _reference(model, samples, weights)
    lp, grads = _packed(model, row, weights)
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    assert grads.keys() == ref_grads.keys() and len(grads) == len(list(model.parameters()))
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= 1e-4, name


def test_ordinary_padded_batch_without_plan_uses_sdpa():
    model = _model("qwen3").eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
        use_tree_attention(model)
        got = model(input_ids=ids, attention_mask=mask).logits
    assert (got[0] - ref[0]).abs().max() <= 1e-5 and (got[1, :6] - ref[1, :6]).abs().max() <= 1e-5


def _dense_reference(row):
    """[T, T] visibility from parent chains: query q sees the tokens on its path to the root."""
    par = row.parent.numpy()
    total = row.num_tokens
    dense = np.zeros((total, total), dtype=bool)
    for q in range(total):
        k = q
        while k >= 0:
            dense[q, k] = True
            k = par[k]
    return torch.from_numpy(dense)


def _large_row(seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(3):
        prompt = list(rng.integers(0, 50, size=150))
        for _ in range(4):
            comp = list(rng.integers(0, 50, size=int(rng.integers(1, 120))))
            samples.append(pack_sample_of(prompt, comp, g))
    return pack_samples(samples)


def pack_sample_of(prompt, comp, group):
    from asyncgrpo.packing.sample import PackSample

    return PackSample(prompt + comp, [0] * len(prompt) + [1] * len(comp), [0.0] * (len(prompt) + len(comp)), 1.0, group)


def test_flex_block_mask_classifies_blocks_exactly():
    from torch.nn.attention.flex_attention import flex_attention

    row = _large_row()
    dense = _dense_reference(row)
    bm = flex_block_mask(row.subtree_end)
    total, blk = row.num_tokens, 128
    nb = -(-total // blk)
    full = torch.zeros(nb, nb, dtype=torch.bool)
    part = torch.zeros(nb, nb, dtype=torch.bool)
    for qb in range(nb):
        full[qb, bm.full_kv_indices[0, 0, qb, : bm.full_kv_num_blocks[0, 0, qb]].long()] = True
        part[qb, bm.kv_indices[0, 0, qb, : bm.kv_num_blocks[0, 0, qb]].long()] = True
    for qb in range(nb):
        for kb in range(nb):
            block = dense[qb * blk : (qb + 1) * blk, kb * blk : (kb + 1) * blk]
            assert bool(full[qb, kb]) == bool(block.all())
            assert bool(part[qb, kb]) == bool(block.any() and not block.all())
    # the kernel (uncompiled, forward only on CPU) agrees with a dense-mask SDPA
    q, k, v = torch.randn(1, 4, total, 16), torch.randn(1, 2, total, 16), torch.randn(1, 2, total, 16)
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[None, None], enable_gqa=True)
    assert (out - ref).abs().max() <= 1e-5


def test_varlen_plan_equals_tree_mask():
    """Each segment's gathered keys, under bottom-right causal alignment, are exactly its tokens' paths."""
    row = _large_row(1)
    dense = _dense_reference(row)
    plan = build_plan(row, "sdpa")
    assert torch.equal(plan.dense_mask, dense)
    from asyncgrpo.packing.attention import _varlen_plan

    vp = _varlen_plan(row, torch.device("cpu"))
    implied = torch.zeros_like(dense)
    cq, ck, kv = vp.cu_seq_q.tolist(), vp.cu_seq_k.tolist(), vp.kv_index
    for s in range(len(cq) - 1):
        lq, lk = cq[s + 1] - cq[s], ck[s + 1] - ck[s]
        for i in range(lq):  # query i sees keys j <= i + (lk - lq)
            implied[cq[s] + i, kv[ck[s] : ck[s] + i + lk - lq + 1]] = True
    assert torch.equal(implied, dense)
    assert vp.max_q == int((row.seg_end - row.seg_start).max())


def test_cuda_backends_refuse_cpu():
    row = _large_row()
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_plan(row, "flex", device="cpu")
    with pytest.raises(ValueError, match="unknown"):
        build_plan(row, "triton")


def test_auto_picks_the_kernel_by_row_length_where_flash_attention_runs(monkeypatch):
    from asyncgrpo.packing import attention

    monkeypatch.setattr(attention, "have_triton", lambda: True)
    monkeypatch.setattr(attention, "varlen_runs", lambda device, dtype=None: dtype in (None, torch.bfloat16))
    edge = attention.VARLEN_FROM_TOKENS
    assert attention.resolve_backend("auto", "cpu", row_tokens=10 * edge) == "sdpa"  # off CUDA, whatever the rows
    assert attention.resolve_backend("auto", "cuda", row_tokens=None) == "flex"  # rows not known yet
    assert attention.resolve_backend("auto", "cuda", row_tokens=edge - 1) == "flex"
    assert attention.resolve_backend("auto", "cuda", row_tokens=edge, dtype=torch.bfloat16) == "varlen"
    assert attention.resolve_backend("auto", "cuda", row_tokens=edge, dtype=torch.float32) == "flex"  # no FA2 in fp32
    assert attention.resolve_backend("flex", "cuda", row_tokens=10 * edge) == "flex"  # an explicit choice stays
    monkeypatch.setattr(attention, "have_triton", lambda: False)  # no Triton: no FlexAttention
    assert attention.resolve_backend("auto", "cuda", row_tokens=100, dtype=torch.bfloat16) == "varlen"
    assert attention.resolve_backend("auto", "cuda", row_tokens=100, dtype=torch.float32) == "sdpa"


def test_varlen_runs_only_in_half_precision():
    from asyncgrpo.packing.attention import varlen_runs

    assert not varlen_runs("cuda", torch.float32)
    if not torch.cuda.is_available():
        assert not varlen_runs("cuda", torch.bfloat16)


def test_lora_model_packed_matches_unpacked():
    rng = np.random.default_rng(11)
    samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=2)
    row = pack_samples(samples)
    model = lora_model(_model("qwen3"), seed=11)  # random A and B: the adapters change the forward
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_grads = _reference(model, samples, weights)
    lp, grads = _packed(model, row, weights)
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    lora = [n for n in grads if "lora_" in n]
    assert lora and all((grads[n] - ref_grads[n]).abs().max().item() <= 1e-4 for n in lora)


def _segment_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=None):
    """FlashAttention's varlen call written out: per segment, queries against their path's keys, causal aligned to
    the bottom right (the queries are the path's last tokens), computed in fp32."""
    out = torch.empty_like(q)
    for s in range(len(cu_q) - 1):
        qs, ks, vs = (t.float() for t in (q[cu_q[s] : cu_q[s + 1]], k[cu_k[s] : cu_k[s + 1]], v[cu_k[s] : cu_k[s + 1]]))
        lq, lk = len(qs), len(ks)
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        o = torch.nn.functional.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1),
                                                             vs.transpose(0, 1), attn_mask=mask)  # fmt: skip
        out[cu_q[s] : cu_q[s + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


def test_varlen_runs_widened_kv_in_the_autocast_dtype_and_refuses_fp32_without_it(monkeypatch):
    """fp32 weights under bf16 autocast reach attention with fp32 q/k (rotary promotes them): the varlen path runs
    them in the autocast dtype, as autocast runs SDPA. The kernel is the segment loop above (it is CUDA-only); the
    plan, the widened gather and the casts are the library's, checked against the dense tree mask."""
    from asyncgrpo.packing import attention

    row = pack_samples(random_tree_samples(np.random.default_rng(3), vocab_size=VOCAB, num_groups=2))
    plan = attention._varlen_plan(row, torch.device("cpu"))
    seen = []

    def kernel(q, k, v, *args, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype, k.shape[1]))
        return _segment_attention(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "_VARLEN_ATTN", kernel)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, row.num_tokens, 8, generator=g) for h in (4, 2, 2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention._varlen(q, k, v, plan, None)
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.bfloat16, 4)]  # K/V widened to the 4 query heads
    mask = build_plan(row, "sdpa").dense_mask
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(out.float(), want, atol=3e-2)
    with pytest.raises(TypeError, match="bf16 autocast"):
        attention._varlen(q, k, v, plan, None)

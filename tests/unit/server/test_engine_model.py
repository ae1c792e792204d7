"""Our paged forward equals the HF forward (fp32, CPU) for Llama, Qwen2 and Qwen3.

Sequences of different lengths are prefilled together, then decoded token by
token through block tables that are deliberately scattered over the cache and
cross block boundaries (block_size 4). Every logit row is compared with the
logits of one full HF forward over the same tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from asyncgrpo.assets import tiny_model
from asyncgrpo.server.engine.kv_cache import KVCache
from asyncgrpo.server.engine.request import Request, SamplingParams
from asyncgrpo.server.engine.runner import ModelRunner
from asyncgrpo.server.engine.scheduler import Sequence
from asyncgrpo.server.models.decoder import DecoderLM, check_architecture

BLOCK = 4
MAX_LEN = 64


def _setup(hf):
    model = DecoderLM(hf, MAX_LEN)
    kv = KVCache(len(model.layers), 64, BLOCK, model.num_kv_heads, model.head_dim, model.dtype, model.device)
    return model, kv, ModelRunner(model, kv, max_num_seqs=8, max_model_len=MAX_LEN, use_graphs=False)


def _seq(prompt: list[int], blocks: list[int]) -> Sequence:
    s = Sequence(Request("r", prompt, SamplingParams(max_tokens=8)), on_finish=lambda out: None)
    s.block_table = list(blocks)
    return s


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("qwen3", {"tie_word_embeddings": True}),
        ("llama", {"attention_bias": True}),
    ],
)
@pytest.mark.parametrize("row_prefill", [False, True])
def test_prefill_and_decode_logits_match_hf(arch, overrides, row_prefill):
    """``row_prefill``: the prefill runs one decode-style row per token (on CUDA, a graph replay)."""
    hf = tiny_model(arch, seed=1, **overrides)
    model, kv, runner = _setup(hf)
    runner.row_prefill.enabled = row_prefill
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 9, 1]
    prompts = [torch.randint(0, model.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    free = list(range(kv.num_blocks))
    random.Random(0).shuffle(free)  # scattered, non-monotonic block tables
    seqs = [_seq(p, [free.pop() for _ in range(MAX_LEN // BLOCK)]) for p in prompts]

    logits = runner.prefill(seqs)  # [3, V]: last position of each sequence
    assert runner.row_prefill.steps == int(row_prefill)
    steps = [logits]
    for _ in range(6):  # teacher-forced decode: append a fixed random token to every sequence
        for s in seqs:
            s.token_ids.append(int(torch.randint(0, model.vocab_size, (1,), generator=gen)))
        steps.append(runner.decode(seqs).clone())

    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([s.token_ids])).logits[0]  # [L, V]
        n = lengths[i]
        for step, got in enumerate(steps):
            torch.testing.assert_close(got[i], ref[n - 1 + step], atol=1e-4, rtol=1e-4)


def test_row_prefill_takes_only_small_prefills():
    """Long new parts, more rows than the largest graph, or too many block copies prefill eagerly."""
    from asyncgrpo.server.engine.row_prefill import MAX_COPIES, MAX_SEQ_TOKENS, ROW_BUCKETS, RowPrefill

    model = DecoderLM(tiny_model("qwen3", seed=1), MAX_LEN)
    kv = KVCache(len(model.layers), 64, BLOCK, model.num_kv_heads, model.head_dim, model.dtype, model.device)
    rows = RowPrefill(model, kv, max_num_seqs=100, max_blocks=MAX_LEN // BLOCK, max_rows=ROW_BUCKETS[-1])
    assert not rows.fits([_seq([1] * 8, [0, 1])])  # off until graphs are captured
    rows.enabled = True
    assert rows.fits([_seq([1] * 8, [0, 1])])
    assert not rows.fits([_seq([1] * (MAX_SEQ_TOKENS + 1), [])])
    long_ones = [_seq([1] * MAX_SEQ_TOKENS, []) for _ in range(ROW_BUCKETS[-1] // MAX_SEQ_TOKENS)]
    assert rows.fits(long_ones) and not rows.fits(long_ones + [_seq([1], [])])  # one row past the largest bucket
    copying = [_seq([1] * 4, [0]) for _ in range(MAX_COPIES + 1)]
    for s in copying:
        s.copy_src = 1
    assert rows.fits(copying[:MAX_COPIES]) and not rows.fits(copying)
    assert not rows.fits([_seq([1], [])] * 101)  # more sequences than logit rows


def test_row_prefill_graphs_shrink_at_long_context():
    """A row carries its sequence's block table: at a long max_model_len the largest row graph is smaller, so one
    step's host-to-device copy stays within MAX_STAGING_BYTES."""
    from asyncgrpo.server.engine.row_prefill import _META, MAX_STAGING_BYTES, ROW_BUCKETS, RowPrefill

    model = DecoderLM(tiny_model("qwen3", seed=1), MAX_LEN)
    kv = KVCache(len(model.layers), 64, BLOCK, model.num_kv_heads, model.head_dim, model.dtype, model.device)
    for max_blocks in (256, 8192):  # max_model_len 4k and 128k at block size 16
        rows = RowPrefill(model, kv, max_num_seqs=256, max_blocks=max_blocks, max_rows=ROW_BUCKETS[-1])
        assert rows.buckets[-1] * 8 * (_META + max_blocks) <= MAX_STAGING_BYTES
        assert rows._static.numel() * 8 <= MAX_STAGING_BYTES
    assert RowPrefill(model, kv, 256, 256, ROW_BUCKETS[-1]).buckets[-1] == ROW_BUCKETS[-1]  # 4k: all of them


def test_rejects_unsupported_architecture():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        check_architecture(gpt2)


def test_padded_decode_rows_do_not_disturb_real_rows():
    """CUDA-graph buckets pad the batch with rows that use the sink block; real rows must not notice."""
    hf = tiny_model("qwen3", seed=2)
    _model, kv, runner = _setup(hf)
    seqs = [_seq([5, 6, 7, 8, 9], range(4)), _seq([1, 2, 3], range(4, 8))]
    runner.prefill(seqs)
    for s in seqs:
        s.token_ids.append(11)
    runner._fill_static(seqs, rows=8)  # 6 padding rows, as for a graph bucket of 8
    padded = runner._decode_forward(8, max_ctx=6)[:2].clone()
    sink_before = kv.layers[0][0][kv.pad_block].clone()
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ref = hf(torch.tensor([s.token_ids])).logits[0, -1]
            torch.testing.assert_close(padded[i], ref, atol=1e-4, rtol=1e-4)
    assert not torch.equal(sink_before, torch.zeros_like(sink_before))  # the padding rows wrote into the sink only
    used = {b for s in seqs for b in s.block_table} | {kv.pad_block}
    untouched = [b for b in range(kv.num_blocks) if b not in used]
    assert all(not kv.layers[0][0][b].any() for b in untouched)

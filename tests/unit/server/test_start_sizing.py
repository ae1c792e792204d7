"""What the engine sizes at start: the KV cache (never more than can be in flight) and the decode graph buckets.

The KV numbers are worked out by hand from the rule in ``kv_cache.py``. The lazy-capture bookkeeping is checked on
CPU where it is reachable without CUDA: the rows a decode runs once buckets are planned (what ``capture_graphs``
leaves on a GPU in lazy mode), and what happens when a capture fails: this machine has no CUDA, so the capture
after the first step of a bucket really fails (no CUDA here, nor the buffers a start capture makes), and the
engine must go on decoding eagerly with the same logits.
"""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.assets import tiny_model
from asyncgrpo.server.engine.kv_cache import CPU_KV_CACHE_BYTES, KVCache, plan_num_blocks, size_to_need
from asyncgrpo.server.engine.request import Request, SamplingParams
from asyncgrpo.server.engine.runner import ModelRunner, graph_buckets
from asyncgrpo.server.engine.scheduler import Sequence
from asyncgrpo.server.models.decoder import DecoderLM


def _plan(**kw):
    base = {"block_size": 16, "bytes_per_token": 1024, "device": torch.device("cpu"), "kv_cache_tokens": None,
            "gpu_memory_utilization": 0.3, "max_num_seqs": 64, "max_model_len": 4096, "headroom_bytes": 0}  # fmt: skip
    return plan_num_blocks(**{**base, **kw})


def test_kv_cache_is_what_can_be_in_flight_unless_memory_allows_less_or_a_size_is_given():
    # 64 sequences x 4096 tokens = 64 x 256 blocks = 16384 blocks (262144 tokens); 1 KiB a token fits the 1 GiB
    assert _plan() == (16384, "max_num_seqs 64 x max_model_len 4096 (the CPU cache's 1024 MiB would allow 1048576)")
    # each sequence holds whole blocks: 4095 tokens still take 256 blocks of 16
    assert _plan(max_model_len=4095)[0] == 64 * 256
    # 8 KiB a token: the 1 GiB holds 131072 tokens = 8192 blocks < 16384
    assert _plan(bytes_per_token=8192) == (
        8192, "the CPU cache's 1024 MiB (max_num_seqs 64 x max_model_len 4096 would need 262144)")  # fmt: skip
    assert _plan(kv_cache_tokens=1000) == (63, "kv_cache_tokens 1000")  # 1000 / 16 = 62.5 -> 63 blocks
    # never below one sequence at full length: 1 MiB a token leaves 1024 tokens of 1 GiB, max_model_len is 2000
    assert _plan(bytes_per_token=1 << 20, max_model_len=2000)[0] == 125  # 2000 / 16
    assert CPU_KV_CACHE_BYTES == 1 << 30  # the numbers above assume it


def test_the_gpu_memory_fraction_caps_at_what_can_be_in_flight():
    """The CUDA branch's choice (its fraction comes from the device's free memory): a fraction that would allow
    1819088 tokens (113693 blocks) with 64 x 4096 in flight gives 262144 tokens; 1024 x 4096 would need more."""
    assert size_to_need(64 * 256, 113693, 16, "max_num_seqs 64 x max_model_len 4096", "gpu_memory_utilization 0.3") == (
        16384, "max_num_seqs 64 x max_model_len 4096 (the gpu_memory_utilization 0.3 would allow 1819088)")  # fmt: skip
    blocks, why = size_to_need(1024 * 256, 113693, 16, "max_num_seqs 1024 x max_model_len 4096", "fraction")
    assert (blocks, why) == (113693, "the fraction (max_num_seqs 1024 x max_model_len 4096 would need 4194304)")
    with pytest.raises(ValueError, match="kv_cache_tokens must be positive"):
        _plan(kv_cache_tokens=0)


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert graph_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 96, 100]


def _runner():
    hf = tiny_model("llama", seed=0)
    model = DecoderLM(hf, 64)
    kv = KVCache(len(model.layers), 64, 4, model.num_kv_heads, model.head_dim, model.dtype, model.device)
    return ModelRunner(model, kv, max_num_seqs=8, max_model_len=64, use_graphs=True), model.vocab_size


def _seqs(n: int, vocab: int) -> list[Sequence]:
    gen = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        prompt = torch.randint(0, vocab, (5 + 3 * i,), generator=gen).tolist()
        s = Sequence(Request(f"r{i}", prompt, SamplingParams(max_tokens=4)), on_finish=lambda out: None)
        s.block_table = list(range(4 * i, 4 * i + 4))  # 16 tokens each, disjoint
        out.append(s)
    return out


def test_cpu_runs_exact_rows_and_plans_no_graphs():
    runner, _ = _runner()
    runner.capture_graphs()  # checks and captures nothing off CUDA
    assert not runner.use_graphs and runner.lazy_buckets_left == [] and runner._bucket(3) == 3
    assert not runner.row_prefill.enabled and runner.backend == "torch-eager"


@torch.no_grad()
def test_a_planned_bucket_runs_padded_and_a_failed_capture_falls_back_to_exact_eager_rows():
    runner, vocab = _runner()
    ref_runner, _ = _runner()
    runner.use_graphs, runner._planned = True, graph_buckets(8)  # as capture_graphs leaves them, lazy, on a GPU
    runner.row_prefill.enabled = True  # as its start capture leaves it
    assert [runner._bucket(n) for n in (1, 3, 5, 8)] == [1, 4, 8, 8]
    assert runner.lazy_buckets_left == [1, 2, 4, 8]
    seqs, ref = _seqs(3, vocab), _seqs(3, vocab)
    torch.testing.assert_close(runner.prefill(seqs), ref_runner.prefill(ref), atol=1e-5, rtol=0)
    for s, r in zip(seqs, ref):
        s.token_ids.append(7)
        r.token_ids.append(7)
    got = runner.decode(seqs)  # 4 rows (one padding row on the sink block), then the capture fails here
    torch.testing.assert_close(got, ref_runner.decode(ref), atol=1e-5, rtol=0)
    assert got.shape[0] == 3
    # no CUDA: the capture failed, every graph is dropped and decoding goes on eagerly with exact rows
    assert runner.lazy_buckets_left == [] and not runner.use_graphs and runner._bucket(3) == 3
    assert not runner.row_prefill.enabled

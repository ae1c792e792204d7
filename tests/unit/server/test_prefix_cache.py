"""Automatic prefix caching on CPU: block pool rules, and engine outputs equal with the cache on and off.

The reference for outputs is the same engine with caching off (whose greedy
tokens and log-probs other tests check against HF); counters are checked
against a hand count of full blocks.
"""

from __future__ import annotations

import threading

import pytest
import torch

from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.kv_cache import KVCache
from asyncgrpo.server.engine.request import Request, RequestOutput, SamplingParams

BS = 4  # small blocks: prompts of a dozen tokens span several


def _pool(num_blocks: int = 6) -> KVCache:
    return KVCache(1, num_blocks, BS, 1, 2, torch.float32, torch.device("cpu"), enable_prefix_caching=True)


def test_pool_shares_equal_prefixes_and_evicts_lru_only_when_needed():
    kv = _pool()
    a = list(range(10))
    keys = kv.block_keys(a, None)[:2]
    assert len(kv.block_keys(a, None)) == 3  # the last one covers the partial block
    assert keys == kv.block_keys(a + [99], None)[:2] and kv.block_keys(a + [99], None)[2] != kv.block_keys(a, None)[2]
    assert kv.block_keys(a, 7)[:2] != keys  # another adapter never shares
    assert kv.block_keys([0, 1, 2, 3, 9, 9, 9, 9], None)[0] == keys[0]  # chained: same first block
    assert kv.block_keys([0, 1, 2, 3, 9, 9, 9, 9], None)[1] != keys[1]

    blocks = kv.allocate(3)
    kv.register(blocks[:2], keys)
    assert kv.lookup(keys) == blocks[:2]  # a second owner
    held = list(blocks[:2])
    kv.free(blocks)  # first owner done: the keyed blocks are still referenced by the second
    assert kv.num_free == 6 - 2
    kv.free(list(held))  # free() empties the list it is given
    assert kv.num_free == 6 and kv.num_cached_blocks == 2  # free but still cached
    got = kv.allocate(4)  # 4 never-keyed blocks exist: the cached ones survive
    assert set(got).isdisjoint(held) and kv.lookup(keys) == held
    kv.free(list(held))
    kv.allocate(1)  # now an eviction: the least recently freed keyed block goes (the tail one, freed first)
    assert kv.num_cached_blocks == 1 and kv.lookup(keys) == [held[0]]


def test_reset_forgets_keys_but_not_owners():
    kv = _pool()
    keys = kv.block_keys(list(range(8)), None)
    blocks = kv.allocate(2)
    kv.register(blocks, keys)
    kv.reset_prefix_cache()
    assert kv.lookup(keys) == [] and kv.num_free == 4
    kv.free(blocks)
    assert kv.num_free == 6 and kv.num_cached_blocks == 0


class _Collector:
    def __init__(self) -> None:
        self.outputs: dict[str, RequestOutput] = {}
        self._cv = threading.Condition()

    def __call__(self, out: RequestOutput) -> None:
        with self._cv:
            self.outputs[out.request_id] = out
            self._cv.notify_all()

    def wait(self, n: int) -> dict[str, RequestOutput]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.outputs) >= n, timeout=120), "requests did not finish"
        return self.outputs


def _engine(caching: bool, row_prefill: bool = False) -> Engine:
    engine = Engine(
        tiny_model_dir("qwen3"), device="cpu", max_model_len=64, max_num_seqs=32, block_size=BS,
        kv_cache_tokens=2048, enable_prefix_caching=caching,
    )  # fmt: skip
    engine._runner.row_prefill.enabled = row_prefill  # on CUDA the captured graphs switch it on; here it runs eagerly
    return engine


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[RequestOutput]:
    """Submit all before the engine thread runs, so they are admitted in one step (the GRPO-group shape)."""
    col = _Collector()
    for i, p in enumerate(prompts):
        engine.submit(Request(f"{tag}-{i}", p, params), col)
    engine.start()
    outs = col.wait(len(prompts))
    return [outs[f"{tag}-{i}"] for i in range(len(prompts))]


def warm_cache(engine: Engine) -> SamplingParams:
    """Run BASES[0] twice (the second run hits its 3 full blocks: 12 tokens); returns the greedy params used."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    _run(engine, [BASES[0]], params, "a")
    _run(engine, [BASES[0]], params, "b")
    assert engine.stats().prefix_cache_hits_total == 12
    return params


GROUP = 4
BASES = [[(7 * j + 3 * i) % 500 + 2 for i in range(13)] for j in range(3)]  # 13 tokens: 3 full blocks + 1
# two groups with equal prompts, one prompt that shares only its first two blocks, two of exactly 3 blocks
PROMPTS = [BASES[0]] * GROUP + [BASES[1]] * GROUP + [BASES[0][:8] + BASES[2][:5]] + [BASES[2][:12]] * 2


@pytest.fixture(scope="module")
def runs():
    out = {}
    for key, caching, rows in ((False, False, False), (True, True, False), ("rows", True, True)):
        engine = _engine(caching, rows)
        try:
            greedy = _run(engine, PROMPTS, SamplingParams(max_tokens=6, temperature=0.0, logprobs=3), "g")
            before = engine.stats()
            seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=11, logprobs=2)
            sampled = _run(engine, PROMPTS[:GROUP], seeded, "s")  # second wave: hits blocks of the first
            out[key] = (greedy, sampled, before, engine.stats(), engine._runner.row_prefill.steps)
        finally:
            engine.shutdown()
    return out


@pytest.mark.parametrize("key", [True, "rows"])
def test_outputs_equal_with_and_without_cache(runs, key):
    """Also with every prefill run row-wise (``row_prefill.py``: block copies of same-step hits included)."""
    assert runs[key][4] == (2 if key == "rows" else 0)  # two waves, one prefill step each
    for off, on in zip(runs[False][0] + runs[False][1], runs[key][0] + runs[key][1]):
        assert on.token_ids == off.token_ids
        assert on.logprobs == pytest.approx(off.logprobs, abs=1e-4)
        for a, b in zip(on.top_logprobs, off.top_logprobs):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert [v for _, v in a] == pytest.approx([v for _, v in b], abs=1e-4)


@pytest.mark.parametrize("key", [True, "rows"])
def test_hit_counters_match_a_hand_count(runs, key):
    _, _, first, end, _ = runs[key]
    # one step admits all: the first of each group misses, each later one shares 3 blocks (12 tokens) and copies
    # the 1-token last block (nothing to reuse there: its only token is computed), the mixed prompt shares
    # BASES[0]'s first 2 blocks; the second 12-token prompt shares 2 blocks and copies 3 of the 4 tokens of its
    # last block (the last token is always computed)
    hits = (GROUP - 1) * 12 * 2 + 8 + 11
    queries = sum(len(p) for p in PROMPTS)
    assert first.prefix_cache_hits_total == hits
    assert first.prefix_cache_queries_total == queries
    assert first.prefill_tokens_computed_total == queries - hits
    # second wave: 4 prompts of BASES[0], each reuses 3 blocks
    assert end.prefix_cache_hits_total - first.prefix_cache_hits_total == GROUP * 12
    assert end.prefill_tokens_computed_total - first.prefill_tokens_computed_total == GROUP * 1
    off_first, off_end = runs[False][2], runs[False][3]
    assert off_first.prefix_cache_hits_total == 0 and off_first.prefill_tokens_computed_total == queries
    assert off_end.prefill_tokens_computed_total == queries + GROUP * 13


def test_weight_load_and_reset_invalidate():
    engine = _engine(True)
    try:
        params = warm_cache(engine)
        assert engine.reset_prefix_cache() is True
        _run(engine, [BASES[0]], params, "c")
        assert engine.stats().prefix_cache_hits_total == 12  # missed after the reset
        _run(engine, [BASES[0]], params, "d")
        assert engine.stats().prefix_cache_hits_total == 24
        name, tensor = next(engine.named_parameters())
        engine.run_between_steps(lambda: engine.load_weights([(name, tensor.clone())]), timeout=30)
        _run(engine, [BASES[0]], params, "e")
        assert engine.stats().prefix_cache_hits_total == 24  # missed after the weight load
    finally:
        engine.shutdown()

"""How the engine keeps a sequence's top-N log-probs while it generates, and hands them over when it ends.

They are kept as flat ids and log-probs plus a count per token. An ``(id, log-prob)`` tuple per entry, as before,
was ~2,000 new objects for the garbage collector per step at batch 256; in a 256 x 256-token run with top-8 the
engine thread went through 6-7 full collections (~150 ms of pauses) that the flat lists do not cause. Values are
checked against the pairs view of the same steps and against a packed copy built from them by hand.
"""

from __future__ import annotations

import gc
import threading

import numpy as np

from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.packed_top import PACK_MIN_ENTRIES, PackedTop, engine_top
from asyncgrpo.server.engine.request import Request, RequestOutput, SamplingParams


def test_engine_top_packs_large_and_keeps_small_as_pairs() -> None:
    ids, values, counts = [5, 9, 7, 1, 2], [-0.1, -2.0, -0.3, -0.5, -4.0], [2, 0, 3]
    small = engine_top(ids, values, counts)
    assert small == [[(5, -0.1), (9, -2.0)], [], [(7, -0.3), (1, -0.5), (2, -4.0)]]
    n = PACK_MIN_ENTRIES
    big = engine_top(list(range(n)), [-float(i) for i in range(n)], [4] * (n // 4))
    # the sampler's values are float32 values: kept as float32; one value that is not keeps all of them as doubles
    assert isinstance(big, PackedTop) and big.ids.dtype == np.int64 and big.values.dtype == np.float32
    assert big[1] == [(4, -4.0), (5, -5.0), (6, -6.0), (7, -7.0)] and len(big) == n // 4
    odd = engine_top(list(range(n)), [-0.1] + [-float(i) for i in range(1, n)], [4] * (n // 4))
    assert odd.values.dtype == np.float64 and odd[0][0] == (0, -0.1)


def test_packed_top_pickles_as_one_block_and_reads_back_the_same() -> None:
    """A 256-token top-8 answer's top-N: one block of int32 ids and counts and float32 values (~20 KB, where
    three int64/float64 arrays took ~37 KB); the pairs read back are the same, doubles stay doubles."""
    import pickle
    import random

    rng = random.Random(3)
    ids = [rng.randrange(151_936) for _ in range(2048)]
    singles = np.array([-rng.random() * 9 for _ in range(2048)], dtype=np.float32).tolist()
    counts = [8] * 256
    top = engine_top(ids, singles, counts)
    blob = pickle.dumps(top, protocol=pickle.HIGHEST_PROTOCOL)
    back = pickle.loads(blob)
    assert len(blob) < 2048 * 8 + 256 * 4 + 200
    assert back.values.dtype == np.float32 and list(back) == list(top)
    assert [p for row in back for p in row] == list(zip(ids, singles))
    doubles = [-rng.random() for _ in range(2048)]
    back = pickle.loads(pickle.dumps(engine_top(ids, doubles, counts)))
    assert back.values.dtype == np.float64 and [v for row in back for _, v in row] == doubles


def test_generation_adds_no_collected_object_per_top_entry() -> None:
    eng = Engine(tiny_model_dir("qwen3"), device="cpu", max_model_len=96, max_num_seqs=16)
    eng.start()
    outs: dict[str, RequestOutput] = {}
    done = threading.Event()

    def cb(o: RequestOutput) -> None:
        outs[o.request_id] = o
        if len(outs) == 16:
            done.set()

    try:
        params = [SamplingParams(max_tokens=64, min_tokens=64, ignore_eos=True, temperature=1.0, seed=i, logprobs=8)
                  for i in range(16)]  # fmt: skip
        eng.submit(Request("warm", [3, 4], SamplingParams(max_tokens=4, logprobs=8)), lambda o: None)
        gc.collect()
        gc.disable()  # count what generation leaves behind, not what a collection happened to free meanwhile
        try:
            before = len(gc.get_objects())
            for i, p in enumerate(params):
                eng.submit(Request(f"r{i}", [5 + i, 6, 7, 8], p), cb)
            assert done.wait(120), "generation did not finish"
            grown = len(gc.get_objects()) - before
        finally:
            gc.enable()
    finally:
        eng.shutdown()
    entries = 16 * 64 * 8
    assert grown < entries // 8, f"{grown} new collected objects for {entries} top-N entries"
    for o in outs.values():  # 512 entries each: packed, one row per token, best first
        top = o.top_logprobs
        assert isinstance(top, PackedTop) and len(top) == 64 and (top.counts == 8).all()
        for k, (token, lp) in enumerate(zip(o.token_ids, o.logprobs)):  # each row is the distribution sampled from
            ids, vals = top.ids[k * 8 : k * 8 + 8].tolist(), top.values[k * 8 : k * 8 + 8].tolist()
            assert vals == sorted(vals, reverse=True) and lp <= vals[0] + 1e-6
            if token in ids:
                assert abs(vals[ids.index(token)] - lp) < 1e-5

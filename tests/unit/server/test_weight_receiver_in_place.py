"""A real engine (tiny Qwen3, CPU) receives an unpacked round over a gloo pair: every tensor lands straight in its
parameter's storage, and, as a copying load does, the prefix cache is emptied."""

from __future__ import annotations

import torch

from asyncgrpo.server.engine.settings import ReceiverSettings
from asyncgrpo.server.engine.weight_receiver import WeightReceiver
from asyncgrpo.weights.collectives import TensorMeta, dtype_name
from asyncgrpo.weights.wire import send_tensors
from tests.unit.server.test_prefix_cache import BASES, _engine, _run, warm_cache
from tests.unit.weights.test_client_collectives import _run_pair


def test_unpacked_round_lands_in_place_and_resets_the_prefix_cache():
    engine = _engine(True)
    try:
        params = warm_cache(engine)
        named = list(engine.named_parameters())
        ptrs = {n: p.data_ptr() for n, p in named}
        g = torch.Generator().manual_seed(0)
        new = [(n, p.detach() + 0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype)) for n, p in named]
        metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in new]
        info = {"names": [m.name for m in metas], "dtype_names": [dtype_name(m.dtype) for m in metas],
                "shapes": [list(m.shape) for m in metas]}  # fmt: skip

        def receiver(group):
            rec = WeightReceiver(engine, ReceiverSettings("gloo", timeout_s=30))
            rec.group, rec.packed, rec.active = group, False, True
            rec.update(info)
            return True

        _run_pair(lambda grp: send_tensors(grp, (t for _, t in new), metas, packed=False), receiver)
        for (name, p), (_, want) in zip(engine.named_parameters(), new):
            assert p.data_ptr() == ptrs[name], name  # same storage: received in place
            assert torch.equal(p.detach(), want), name
        _run(engine, [BASES[0]], params, "c")
        assert engine.stats().prefix_cache_hits_total == 12  # missed: the cache was emptied by the update
    finally:
        engine.shutdown()

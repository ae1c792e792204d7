"""The fused decode kernels and prefix caching on CUDA, each against the torch path (the sampling kernels:
test_sample_kernel_gpu.py).

Run on the GPU machine: ``python -m pytest -q -m gpu tests/gpu/test_engine_fused_gpu.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request, RequestOutput, SamplingParams
from asyncgrpo.server.layers import fused
from tests.gpu.test_engine_gpu import tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_kernels_match_the_torch_path_on_cuda(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    T, Hq, Hkv, D, L = 37, 16, 8, 128, 512

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)

    qkv = rnd(T, (Hq + 2 * Hkv) * D, scale=2.0)
    pos = torch.randint(0, L, (T,), device="cuda", generator=g)
    ang = torch.arange(L, device="cuda")[:, None] * (1e-2 ** torch.linspace(0, 1, D // 2, device="cuda"))[None]
    cos, sin = torch.cat([ang, ang], 1).cos().to(dtype), torch.cat([ang, ang], 1).sin().to(dtype)
    qn, kn = (rnd(D), 1e-6), (rnd(D), 1e-6)
    slots = torch.randperm(64 * 16, device="cuda", generator=g)[:T]
    outs = {}
    for force in (True, False):
        kc = torch.zeros(65, 16, Hkv, D, device="cuda", dtype=dtype)
        vc = torch.zeros_like(kc)
        q, k, v = fused.qkv_rope_write(qkv, pos, cos, sin, qn, kn, slots, kc, vc, Hq, Hkv, True, force=force)
        h, x = fused.add_rms_norm(qkv[:, :1024], qkv[:, 1024:2048], qn[0].repeat(8), 1e-6, force=force)
        a = fused.silu_mul(qkv[:, :2048], force=force)
        outs[force] = [t.float() for t in (q, k, v, kc, vc, h, x, a)]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, got, ref in zip(["q", "k", "v", "k_cache", "v_cache", "h", "x", "silu_mul"], outs[True], outs[False]):
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


def _run(eng: Engine, prompts: list[list[int]], tag: str) -> list[RequestOutput]:
    outs: dict[str, RequestOutput] = {}
    done = threading.Event()

    def cb(o):
        outs[o.request_id] = o
        if len(outs) == len(prompts):
            done.set()

    for i, p in enumerate(prompts):
        eng.submit(Request(f"{tag}{i}", p, SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)), cb)
    assert done.wait(120), "requests did not finish"
    return [outs[f"{tag}{i}"] for i in range(len(prompts))]


def test_prefix_caching_keeps_greedy_outputs_on_cuda():
    gen = torch.Generator().manual_seed(3)
    base = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (48, 53, 7, 33)]
    prompts = [p for p in base for _ in range(4)]
    results = {}
    for caching in (False, True):
        eng = Engine(tiny_model().to("cuda"), max_model_len=128, max_num_seqs=32, kv_cache_tokens=4096,
                     enable_prefix_caching=caching)  # fmt: skip
        eng.start()
        try:
            results[caching] = _run(eng, prompts, "a") + _run(eng, prompts, "b")
            stats = eng.stats()
        finally:
            eng.shutdown()
        if caching:
            assert stats.prefix_cache_hits_total > 0
            assert stats.prefill_tokens_computed_total < sum(len(p) for p in prompts)
    for off, on in zip(results[False], results[True]):
        assert on.token_ids == off.token_ids
        assert on.logprobs == pytest.approx(off.logprobs, abs=2e-3)

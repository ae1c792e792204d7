"""The fused RMSNorm kernel (interpreted on CPU) against HF's RMSNorm module."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CHILD = """
import sys, torch
from asyncgrpo.server.layers import fused_triton
d = torch.load(sys.argv[1] + "/in.pt")
x, w = d["x"], d["w"]
out = torch.empty_like(x)
fused_triton.rms_norm_kernel[(x.shape[0],)](x, w, out, x.stride(0), out.stride(0), x.shape[1], 1e-6, BLOCK=128)
torch.save(out, sys.argv[1] + "/out.pt")
"""


def test_rms_norm_kernel_matches_hf(tmp_path):
    pytest.importorskip("triton")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x = torch.randn(7, 96) * 3
    norm = LlamaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96))
        expected = norm(x)
    torch.save({"x": x, "w": norm.weight.detach().clone()}, tmp_path / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt")
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_torch_path_is_hf_arithmetic():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from asyncgrpo.server.layers.fused import rms_norm

    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    norm = LlamaRMSNorm(16, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
        assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))


LAYER_CHILD = """
import sys, torch
from asyncgrpo.server.layers import fused
d = torch.load(sys.argv[1] + "/in.pt")
out = {}
for dtype in (torch.float32, torch.bfloat16):
    c = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in d.items()}
    for force in (True, False):
        kc, vc = torch.zeros_like(c["cache"]), torch.zeros_like(c["cache"])
        static = torch.stack([c["pos"] * 0 + 99, c["pos"], c["slots"], c["pos"] * 0 + 77], 1)  # strided columns
        q, k, v = fused.qkv_rope_write(c["qkv"], static[:, 1], c["cos"], c["sin"], (c["qn"], 1e-6), (c["kn"], 1e-6),
                                       static[:, 2], kc, vc, 4, 2, True, force=force)
        h, x = fused.add_rms_norm(c["h"], c["delta"], c["w"], 1e-6, force=force)
        a = fused.silu_mul(c["gu"], force=force)
        out[(str(dtype), force)] = [t.float() for t in (q, k, v, kc, vc, h, x, a)]
    # the rope kernel with a token's 8 heads split over 4 programs (a large model's case), against the torch path
    default_block, fused.ROPE_BLOCK_VALUES = fused.ROPE_BLOCK_VALUES, 2 * c["cos"].shape[-1]
    kc, vc = torch.zeros_like(c["cache"]), torch.zeros_like(c["cache"])
    q, k, v = fused.qkv_rope_write(c["qkv"], static[:, 1], c["cos"], c["sin"], (c["qn"], 1e-6), (c["kn"], 1e-6),
                                   static[:, 2], kc, vc, 4, 2, True, force=True)
    fused.ROPE_BLOCK_VALUES = default_block
    out[(str(dtype), "split")] = [t.float() for t in (q, k, v, kc, vc)]
torch.save(out, sys.argv[1] + "/out.pt")
"""


def test_layer_kernels_match_the_torch_path(tmp_path):
    """Interpreted Triton kernels vs the torch fallbacks (the HF arithmetic) in fp32 and bf16."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(0)
    T, D, L = 5, 16, 12
    angles = torch.arange(L)[:, None] * (0.3 ** torch.arange(D // 2))[None, :]
    angles = torch.cat([angles, angles], dim=1)
    d = {
        "qkv": torch.randn(T, (4 + 2 * 2) * D, generator=g) * 2,
        "pos": torch.tensor([0, 3, 11, 2, 7]),
        "cos": angles.cos(),
        "sin": angles.sin(),
        "qn": torch.randn(D, generator=g),
        "kn": torch.randn(D, generator=g),
        "slots": torch.tensor([9, 0, 4, 13, 6]),
        "cache": torch.zeros(5, 4, 2, D),  # 4 blocks of 4 slots + the sink
        "h": torch.randn(T, 48, generator=g),
        "delta": torch.randn(T, 48, generator=g),
        "w": torch.randn(48, generator=g),
        "gu": torch.randn(T, 2 * 40, generator=g) * 3,
    }
    torch.save(d, tmp_path / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", LAYER_CHILD, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    names = ["q", "k", "v", "k_cache", "v_cache", "residual", "normed", "silu_mul"]
    for dtype, tol in (("torch.float32", 1e-5), ("torch.bfloat16", 2e-2)):
        for name, got, ref in zip(names, out[(dtype, True)], out[(dtype, False)]):
            assert torch.allclose(got, ref, atol=tol, rtol=tol), (
                f"{name} ({dtype}) differs by {(got - ref).abs().max()}"
            )
    assert out[("torch.float32", False)][3].abs().sum() > 0  # the cache was written
    for dtype, tol in (("torch.float32", 1e-5), ("torch.bfloat16", 2e-2)):
        for name, got, ref in zip(names, out[(dtype, "split")], out[(dtype, False)]):
            assert torch.allclose(got, ref, atol=tol, rtol=tol), f"{name} ({dtype}, heads split) differs"

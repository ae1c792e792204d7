"""The fused RMSNorm kernel (interpreted on CPU) against HF's RMSNorm module."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CHILD = """
import sys, torch
from asyncgrpo.server import fused
d = torch.load(sys.argv[1] + "/in.pt")
x, w = d["x"], d["w"]
out = torch.empty_like(x)
fused._rms_norm_kernel[(x.shape[0],)](x, w, out, x.stride(0), out.stride(0), x.shape[1], 1e-6, BLOCK=128)
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

    from asyncgrpo.server.fused import rms_norm

    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    norm = LlamaRMSNorm(16, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
        assert torch.equal(rms_norm(x, norm.weight, 1e-5), norm(x))

"""The LM-head Triton kernels (trainer/head_triton.py), interpreted on CPU, against the eager arithmetic of
trainer/head_kernels.py: a vocabulary that spans several loop steps and ends in a partial block."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CHILD = """
import sys, torch
from asyncgrpo.trainer import head_triton
head_triton.STATS_BLOCK, head_triton.GRAD_BLOCK = 64, 32  # several loop steps and programs per row
d = torch.load(sys.argv[1] + "/in.pt")
out = {}
for t in (1.0, 0.7):
    s, mean = head_triton.row_stats(d["zb"], t, True)
    s2, empty = head_triton.row_stats(d["zb"], t, False)
    out[t] = (s, mean, s2, empty, head_triton.dense_grad(d["zb"], s, d["coef"], t))
torch.save(out, sys.argv[1] + "/out.pt")
"""


def test_row_stats_and_dense_grad_match_the_eager_arithmetic(tmp_path):
    pytest.importorskip("triton")
    from asyncgrpo.trainer.head_kernels import _dense_grad, _row_stats

    g = torch.Generator().manual_seed(0)
    zb = (torch.randn(5, 203, generator=g) * 3).bfloat16()
    coef = torch.randn(5, generator=g)
    torch.save({"zb": zb, "coef": coef}, tmp_path / "in.pt")
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    got = torch.load(tmp_path / "out.pt")
    for t in (1.0, 0.7):
        s, mean, s2, empty, grad = got[t]
        ref_s, ref_mean = _row_stats(zb, t, True)
        assert torch.allclose(s, ref_s, atol=1e-5) and torch.equal(s, s2) and empty.numel() == 0
        assert torch.allclose(mean, ref_mean, atol=1e-5)
        assert grad.dtype == torch.bfloat16
        assert torch.allclose(grad.float(), _dense_grad(zb, ref_s, coef, t).float(), rtol=1e-2, atol=1e-4)

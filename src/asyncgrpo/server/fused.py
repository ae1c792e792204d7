"""Fused element-wise kernels for the decode step (Triton on CUDA, the same arithmetic in torch elsewhere).

At batch 256 a decode step is bound by the *number* of small kernels, not by
their bytes: HF's RMSNorm arithmetic is eight launches (upcast, square, mean,
add, rsqrt, multiply, downcast, scale) and runs four times per layer. One Triton
program per row does it in a single launch with the same arithmetic: normalise
in fp32, cast to the input dtype, then multiply by the weight.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        var = tl.sum(x * x, axis=0) / n_cols
        normed = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # HF: cast back before scaling
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm arithmetic: normalise in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; one kernel on CUDA (graph-safe), torch ops elsewhere."""
    if triton is None or not x.is_cuda or weight.dtype != x.dtype:
        return rms_norm_torch(x, weight, eps)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n_cols = shape[-1]
    _rms_norm_kernel[(x2.shape[0],)](
        x2, weight, out, x2.stride(0), out.stride(0), n_cols, eps, BLOCK=triton.next_power_of_2(n_cols)
    )
    return out.view(shape)

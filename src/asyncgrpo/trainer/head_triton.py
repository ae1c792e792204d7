"""Triton kernels of :mod:`asyncgrpo.trainer.head_kernels` (imported on the first CUDA use only).

One program per row reads the row's logits once for its statistics (online log-sum-exp); the dense gradient is a
2-D grid of row blocks. Both read the logits in their own dtype and compute in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

STATS_BLOCK = 4096  # logits per loop step of a row's statistics
GRAD_BLOCK = 2048  # logits per program of the dense gradient


@triton.jit
def _row_stats_kernel(z_ptr, lse_ptr, mean_ptr, stride, n_cols, inv_t, WANT_MEAN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * stride
    cols = tl.arange(0, BLOCK)
    m = tl.full((), -float("inf"), tl.float32)
    total = tl.full((), 0.0, tl.float32)
    weighted = tl.full((), 0.0, tl.float32)
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        z = tl.load(base + start + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)  # 0 at masked lanes
        total = total * scale + tl.sum(e, axis=0)
        if WANT_MEAN:
            weighted = weighted * scale + tl.sum(tl.where(mask, e * z, 0.0), axis=0)
        m = m_new
    tl.store(lse_ptr + row, m + tl.log(total))
    if WANT_MEAN:
        tl.store(mean_ptr + row, weighted / total)


@triton.jit
def _dense_grad_kernel(z_ptr, lse_ptr, coef_ptr, out_ptr, stride, out_stride, n_cols, inv_t, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    z = tl.load(z_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(z * inv_t - tl.load(lse_ptr + row))
    g = p * (-tl.load(coef_ptr + row) * inv_t)
    tl.store(out_ptr + row * out_stride + cols, g.to(out_ptr.dtype.element_ty), mask=mask)


def row_stats(zb: torch.Tensor, temperature: float, want_mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``head_kernels.row_stats`` on CUDA: one read of each row."""
    zb = zb if zb.stride(1) == 1 else zb.contiguous()
    rows, cols = zb.shape
    lse = torch.empty(rows, dtype=torch.float32, device=zb.device)
    mean = torch.empty(rows if want_mean else 0, dtype=torch.float32, device=zb.device)
    if rows:
        block = min(STATS_BLOCK, triton.next_power_of_2(cols))
        _row_stats_kernel[(rows,)](zb, lse, mean, zb.stride(0), cols, 1.0 / temperature, WANT_MEAN=want_mean,
                                   BLOCK=block, num_warps=8)  # fmt: skip
    return lse, mean


def dense_grad(zb: torch.Tensor, lse: torch.Tensor, coef: torch.Tensor, temperature: float) -> torch.Tensor:
    """``head_kernels.dense_grad`` on CUDA: ``-softmax(z / T) * coef / T`` in ``zb``'s dtype."""
    zb = zb if zb.stride(1) == 1 else zb.contiguous()
    rows, cols = zb.shape
    out = torch.empty_like(zb, memory_format=torch.contiguous_format)
    if rows:
        block = min(GRAD_BLOCK, triton.next_power_of_2(cols))
        grid = (rows, triton.cdiv(cols, block))
        _dense_grad_kernel[grid](zb, lse.contiguous(), coef.float().contiguous(), out, zb.stride(0), out.stride(0),
                                 cols, 1.0 / temperature, BLOCK=block, num_warps=8)  # fmt: skip
    return out

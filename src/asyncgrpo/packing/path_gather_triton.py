"""The Triton kernel of :mod:`asyncgrpo.packing.path_gather` (imported on the first CUDA use only)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_VALUES = 1024  # values of a row one program sums (a bf16 K row of 8 heads x 128: one program per token)


@triton.jit
def _sum_copies_kernel(
    grad_ptr, order_ptr, offsets_ptr, out_ptr, width, head_dim, REPEAT: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # of the output row: head h, value d at h * head_dim + d
    mask = cols < width
    src_cols = cols + (cols // head_dim) * (REPEAT - 1) * head_dim  # repeat 0 of head h in the widened row
    lo = tl.load(offsets_ptr + token)
    hi = tl.load(offsets_ptr + token + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(lo, hi):
        row = grad_ptr + tl.load(order_ptr + i).to(tl.int64) * width * REPEAT
        for r in tl.static_range(REPEAT):
            acc += tl.load(row + src_cols + r * head_dim, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * width + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_kernel(x_ptr, index_ptr, out_ptr, stride_t, stride_h, heads, head_dim, REPEAT: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    pos = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < head_dim)
    src = tl.load(index_ptr + pos).to(tl.int64)
    vals = tl.load(x_ptr + src * stride_t + h * stride_h + d, mask=mask)
    row = out_ptr + pos.to(tl.int64) * heads * REPEAT * head_dim
    for r in tl.static_range(REPEAT):
        tl.store(row + (h * REPEAT + r) * head_dim + d, vals, mask=mask)


def gather_widened(x: torch.Tensor, index: torch.Tensor, repeat: int) -> torch.Tensor:
    """``x[index]`` with each head repeated ``repeat`` times in place: [P, H * repeat, D] from ``x`` [T, H, D]
    (any token and head strides). Each key row is read once and written ``repeat`` times; ``index_select`` on the
    expanded view ran as a generic strided gather, 20 ms of a 1.7B model's step at G = 8 on an H100."""
    if x.stride(2) != 1:
        x = x.contiguous()
    heads, head_dim = x.shape[1:]
    out = torch.empty((index.shape[0], heads * repeat, head_dim), dtype=x.dtype, device=x.device)
    if index.shape[0] == 0 or heads * head_dim == 0:
        return out
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    warps = 4 if block_h * block_d <= 2048 else 8
    _gather_kernel[(index.shape[0],)](x, index, out, x.stride(0), x.stride(1), heads, head_dim, REPEAT=repeat,
                                      BLOCK_H=block_h, BLOCK_D=block_d, num_warps=warps)  # fmt: skip
    return out


def sum_copies(grad: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, repeat: int = 1) -> torch.Tensor:
    """``out[t, h] = sum over i in order[offsets[t]:offsets[t + 1]] and r < repeat of grad[i, h * repeat + r]``
    in fp32, written once per row; ``grad`` is [P, H * repeat, ...]."""
    num_tokens = offsets.shape[0] - 1
    heads = grad.shape[1] // repeat
    out = torch.empty((num_tokens, heads, *grad.shape[2:]), dtype=grad.dtype, device=grad.device)
    width = math.prod(out.shape[1:])
    if num_tokens == 0 or width == 0:
        return out
    head_dim = width // heads
    block = min(BLOCK_VALUES, triton.next_power_of_2(width))
    grid = (num_tokens, triton.cdiv(width, block))
    _sum_copies_kernel[grid](grad, order, offsets, out, width, head_dim, REPEAT=repeat, BLOCK=block)
    return out

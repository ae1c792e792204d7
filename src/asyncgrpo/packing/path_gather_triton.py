"""The Triton kernel of :mod:`asyncgrpo.packing.path_gather` (imported on the first CUDA use only)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

BLOCK_VALUES = 1024  # values of a row one program sums (a bf16 K row of 8 heads x 128: one program per token)


@triton.jit
def _sum_copies_kernel(grad_ptr, order_ptr, offsets_ptr, out_ptr, width, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    lo = tl.load(offsets_ptr + token)
    hi = tl.load(offsets_ptr + token + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(lo, hi):
        src = tl.load(order_ptr + i).to(tl.int64)
        acc += tl.load(grad_ptr + src * width + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * width + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_copies(grad: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum of grad[order[offsets[t]:offsets[t + 1]]]`` in fp32, written once per row."""
    num_tokens = offsets.shape[0] - 1
    out = torch.empty((num_tokens, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
    width = math.prod(grad.shape[1:])
    if num_tokens == 0 or width == 0:
        return out
    block = min(BLOCK_VALUES, triton.next_power_of_2(width))
    _sum_copies_kernel[(num_tokens, triton.cdiv(width, block))](grad, order, offsets, out, width, BLOCK=block)
    return out

"""Keys and values gathered along each trie segment's root-to-leaf path, summed back without atomics.

The varlen tree backend gives FlashAttention one key sequence per segment: the segment's whole path, so a prompt
shared by G completions is gathered G times. ``index_select``'s backward scatters those copies back with
``index_add``: bf16 atomics, contended G ways on every shared token (22 ms of a 1.7B model's step at G = 8 on an
H100, bench/LOG.md issue 37). Here the plan also carries the path positions sorted by token, and on CUDA the
backward gives each token one program that sums its copies in fp32 and writes once: no atomics, deterministic.

``repeat`` also widens each key head to the query heads that share it (grouped-query attention). FlashAttention's
varlen backward with fewer key heads writes query-head-sized dK/dV and sums them with a strided ``reduce_kernel``
that runs at a fifth of the bandwidth (23 ms of the step at G = 16, bench/LOG.md issue 37); given K/V already
widened, it writes dK/dV as they are, and the sum over the heads joins the sum over the copies here, in one pass.
The price: the widened K/V that FlashAttention saves for its backward (``repeat`` x the gathered K/V's memory).
On CUDA the widened gather is a Triton kernel too: ``index_select`` on the expanded view ran as a generic strided
gather that cost as much as the reduction saved.

Both directions are custom ops, opaque to ``torch.compile``: the compiled decoder layers call them as they are,
with no recompiles for rows of new shapes.
"""

from __future__ import annotations

from types import ModuleType

import torch

from asyncgrpo.triton_support import load_kernels

__all__ = ["path_gather", "path_order"]


def path_order(kv_index: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, offsets)``: path positions sorted by the token they copy (stable), and each token's [start, end)
    in that order ([num_tokens + 1]); a token no path copies has an empty range."""
    order = torch.argsort(kv_index, stable=True)
    counts = torch.bincount(kv_index, minlength=num_tokens)
    offsets = torch.zeros(num_tokens + 1, dtype=torch.int64, device=kv_index.device)
    torch.cumsum(counts, 0, out=offsets[1:])
    return order, offsets


def _kernels(t: torch.Tensor) -> ModuleType | None:
    """The Triton kernels for a CUDA tensor (None on CPU, or after one warning without Triton)."""
    if not t.is_cuda:
        return None
    return load_kernels("asyncgrpo.packing.path_gather_triton", "the varlen tree's K/V gather and its gradient sum")


@torch.library.custom_op("asyncgrpo::path_gather", mutates_args=())
def path_gather(
    x: torch.Tensor, index: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, repeat: int = 1
) -> torch.Tensor:
    """``x.index_select(0, index)`` for ``x`` [T, H, D], each head repeated ``repeat`` times in place
    ([P, H * repeat, D], as ``repeat_interleave`` on dim 1); the backward sums each row's copies in one pass."""
    if repeat == 1:
        return x.index_select(0, index)
    kernels = _kernels(x)
    if kernels is not None:
        return kernels.gather_widened(x, index, repeat)
    tokens, heads, dim = x.shape
    widened = x.unsqueeze(2).expand(tokens, heads, repeat, dim)  # a view: the gather reads each head repeat times
    return widened.index_select(0, index).view(index.shape[0], heads * repeat, dim)


@path_gather.register_fake
def _(x, index, order, offsets, repeat=1):
    return x.new_empty((index.shape[0], x.shape[1] * repeat, *x.shape[2:]))


@torch.library.custom_op("asyncgrpo::path_gather_backward", mutates_args=())
def path_gather_backward(
    grad: torch.Tensor, index: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, repeat: int = 1
) -> torch.Tensor:
    """The gradient of :func:`path_gather`'s ``x``: for each row and head, the sum over its copies and repeats."""
    kernels = _kernels(grad)
    if kernels is None:
        if repeat > 1:
            grad = grad.unflatten(1, (grad.shape[1] // repeat, repeat)).sum(2)
        out = grad.new_zeros((offsets.shape[0] - 1, *grad.shape[1:]))
        return out.index_add_(0, index, grad)
    return kernels.sum_copies(grad.contiguous(), order, offsets, repeat)


@path_gather_backward.register_fake
def _(grad, index, order, offsets, repeat=1):
    return grad.new_empty((offsets.shape[0] - 1, grad.shape[1] // repeat, *grad.shape[2:]))


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:4])
    ctx.repeat = inputs[4] if len(inputs) > 4 else 1


def _backward(ctx, grad):
    index, order, offsets = ctx.saved_tensors
    return path_gather_backward(grad, index, order, offsets, ctx.repeat), None, None, None, None


path_gather.register_autograd(_backward, setup_context=_setup)

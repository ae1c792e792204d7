"""Keys and values gathered along each trie segment's root-to-leaf path, summed back without atomics.

The varlen tree backend gives FlashAttention one key sequence per segment: the segment's whole path, so a prompt
shared by G completions is gathered G times. ``index_select``'s backward scatters those copies back with
``index_add``: bf16 atomics, contended G ways on every shared token (22 ms of a 1.7B model's step at G = 8 on an
H100, bench/LOG.md issue 37). Here the plan also carries the path positions sorted by token, and on CUDA the
backward gives each token one program that sums its copies in fp32 and writes once: no atomics, deterministic.

Both directions are custom ops, opaque to ``torch.compile``: the compiled decoder layers call them as they are,
with no recompiles for rows of new shapes.
"""

from __future__ import annotations

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


@torch.library.custom_op("asyncgrpo::path_gather", mutates_args=())
def path_gather(x: torch.Tensor, index: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)``, whose backward sums each row's copies in one pass (see the module)."""
    return x.index_select(0, index)


@path_gather.register_fake
def _(x, index, order, offsets):
    return x.new_empty((index.shape[0], *x.shape[1:]))


@torch.library.custom_op("asyncgrpo::path_gather_backward", mutates_args=())
def path_gather_backward(
    grad: torch.Tensor, index: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """The gradient of :func:`path_gather`'s ``x``: for each row, the sum of the gradients of its copies."""
    num_tokens = offsets.shape[0] - 1
    kernels = None
    if grad.is_cuda:
        kernels = load_kernels("asyncgrpo.packing.path_gather_triton", "the varlen tree's K/V gradient sum")
    if kernels is None:
        out = grad.new_zeros((num_tokens, *grad.shape[1:]))
        return out.index_add_(0, index, grad)
    return kernels.sum_copies(grad.contiguous(), order, offsets)


@path_gather_backward.register_fake
def _(grad, index, order, offsets):
    return grad.new_empty((offsets.shape[0] - 1, *grad.shape[1:]))


def _setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[1:])


def _backward(ctx, grad):
    index, order, offsets = ctx.saved_tensors
    return path_gather_backward(grad, index, order, offsets), None, None, None


path_gather.register_autograd(_backward, setup_context=_setup)

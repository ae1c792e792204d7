"""The elementwise work of the fused LM-head loss over one chunk's [c, V] logits: Triton kernels on CUDA.

Eager, each statistic is its own pass over the chunk's logits in fp32 (cast, max, exp, sum, product, scale,
cast back): tens of bytes of memory traffic per logit. Here the logits stay in the matmul's dtype and two
functions read them once each (``head_triton.py``):

- :func:`row_stats`: log-sum-exp ``s`` and, for the entropy, ``E_p[z]``, in one online pass over each row;
- :func:`dense_grad`: the dense part of the logit gradient, ``-p * coef`` in the matmul's dtype.

These were torch.compile'd functions before: inductor's reduction read each row two to three times (0.7 TB/s
on an H100) and its symbolic temperature cost 4 host syncs per chunk (bench/LOG.md, issue 37). The sparse parts
(the one-hot terms of targets and top-N ids) are applied to the hidden and weight gradients directly by the
caller. Off CUDA, or without Triton (one warning names the package), the eager functions below run: the same
arithmetic.
"""

from __future__ import annotations

import torch

from asyncgrpo.triton_support import load_kernels


def _row_stats(zb: torch.Tensor, temperature: float, want_mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    z = zb.float() / temperature
    m = z.amax(dim=-1, keepdim=True)
    e = (z - m).exp()
    total = e.sum(dim=-1)
    s = m[:, 0] + total.log()
    mean = (e * z).sum(dim=-1) / total if want_mean else s.new_zeros(0)
    return s, mean


def _dense_grad(zb: torch.Tensor, s: torch.Tensor, coef: torch.Tensor, temperature: float) -> torch.Tensor:
    p = (zb.float() / temperature - s[:, None]).exp()
    return (p * (-coef / temperature)[:, None]).to(zb.dtype)


def _kernels(zb: torch.Tensor):
    if not zb.is_cuda:
        return None
    return load_kernels("asyncgrpo.trainer.head_triton", "the LM-head loss kernels")


def row_stats(zb: torch.Tensor, temperature: float, want_mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(zb [c, V], temperature, want_mean) -> (log-sum-exp [c], E_p[z] [c] or empty)``, fp32 results."""
    kernels = _kernels(zb)
    return kernels.row_stats(zb, temperature, want_mean) if kernels else _row_stats(zb, temperature, want_mean)


def dense_grad(zb: torch.Tensor, s: torch.Tensor, coef: torch.Tensor, temperature: float) -> torch.Tensor:
    """``(zb [c, V], lse [c], coef [c], temperature) -> -softmax(z) * coef / temperature`` in ``zb``'s dtype."""
    kernels = _kernels(zb)
    return kernels.dense_grad(zb, s, coef, temperature) if kernels else _dense_grad(zb, s, coef, temperature)

"""The elementwise work of the fused LM-head loss over one chunk's [c, V] logits, fused by torch.compile on CUDA.

Eager, each statistic is its own pass over the chunk's logits in fp32 (cast, max, exp, sum, product, scale,
cast back): tens of bytes of memory traffic per logit. Here the logits stay in the matmul's dtype and two
functions read them once or twice each:

- :func:`row_stats`: log-sum-exp ``s`` and, for the entropy, ``E_p[z]`` (one max pass, one exp-sum pass);
- :func:`dense_grad`: the dense part of the logit gradient, ``-p * coef`` in the matmul's dtype.

The sparse parts (the one-hot terms of targets and top-N ids) are applied to the hidden and weight gradients
directly by the caller. On CUDA both functions are compiled once (dynamic shapes); if compiling fails they run
eager with one warning (without Triton they are not compiled: one warning names the package). Off CUDA they
run eager (the same arithmetic).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from asyncgrpo.triton_support import have_triton, warn_missing

logger = logging.getLogger(__name__)


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


class _Kernel:
    """An eager function with a compiled twin on CUDA that falls back to eager on its first failure."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled: Callable[..., Any] | None = None
        self.floats: Any = None  # trainer/compile.py's constant-floats patch, made with the compiled twin
        self.failed = False

    def __call__(self, *args: Any) -> Any:
        if self.failed or not args[0].is_cuda:
            return self.fn(*args)
        if self.compiled is None:
            if not have_triton():  # torch.compile's CUDA code is Triton
                warn_missing("compiling the LM-head loss kernels")
                self.failed = True
                return self.fn(*args)
            from asyncgrpo.trainer.compile import _constant_floats

            self.compiled = torch.compile(self.fn, dynamic=True)
            # the temperature traced as a constant: as a symbolic float it reached the graphs as a device scalar
            # read back with .item(), 4 host syncs per chunk that left the GPU idle ~4 % of a step (bench/LOG.md)
            self.floats = _constant_floats()
        try:
            with self.floats:
                return self.compiled(*args)
        except Exception as exc:
            from asyncgrpo.trainer.compile import _is_compile_error

            if not _is_compile_error(exc):
                raise
            self.failed = True
            logger.warning("compiling the LM-head kernel %s failed (%s); running it eager", self.fn.__name__, exc)
            return self.fn(*args)


row_stats = _Kernel(_row_stats)
"""``(zb [c, V], temperature, want_mean) -> (log-sum-exp [c], E_p[z] [c] or empty)``, fp32 results."""
dense_grad = _Kernel(_dense_grad)
"""``(zb [c, V], lse [c], coef [c], temperature) -> -softmax(z) * coef / temperature`` in ``zb``'s dtype."""

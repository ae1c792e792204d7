"""Fused element-wise kernels for the decode step (Triton on CUDA, the same arithmetic in torch elsewhere).

At batch 256 a decode step is bound by the *number* of small kernels, not by
their bytes: HF's RMSNorm arithmetic is eight launches (upcast, square, mean,
add, rsqrt, multiply, downcast, scale) and runs four times per layer. One Triton
program per row does it in a single launch with the same arithmetic: normalise
in fp32, cast to the input dtype, then multiply by the weight. The Triton programs live in
``fused_triton.py``, imported on the first CUDA call (a CPU install never imports Triton).
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from asyncgrpo.triton_support import load_kernels

logger = logging.getLogger(__name__)


# values of q/k/v one program of the rope kernel takes: a token's 32 heads of 128 at Qwen3-0.6B's shape (one program
# per (token, head) cost 9.9 us a decode layer at batch 256 on an H100, one per token 4.9 us); larger models split a
# token's heads over programs rather than spill registers (a power of two, as the head dims the kernel takes)
ROPE_BLOCK_VALUES = 4096


def _pow2(n: int) -> int:
    """The smallest power of two >= n (``triton.next_power_of_2`` without importing Triton)."""
    return 1 << max(0, n - 1).bit_length()


def _kernels() -> ModuleType | None:
    """``fused_triton`` on first use, or None without Triton (one warning)."""
    return load_kernels("asyncgrpo.server.layers.fused_triton", "the fused layer kernels of the CUDA engine")


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm arithmetic: normalise in fp32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension; one kernel on CUDA (graph-safe), torch ops elsewhere."""
    kernels = _kernels() if x.is_cuda and weight.dtype == x.dtype else None
    if kernels is None:
        return rms_norm_torch(x, weight, eps)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n_cols = shape[-1]
    kernels.rms_norm_kernel[(x2.shape[0],)](
        x2, weight, out, x2.stride(0), out.stride(0), n_cols, eps, BLOCK=_pow2(n_cols)
    )
    return out.view(shape)


ENABLED = {"layer": True}  # switched off for the process when the self-check below fails on this machine


def _use_triton(x: torch.Tensor, force: bool | None) -> bool:
    """Triton on CUDA; ``force=True`` also on CPU (tests run the kernels under ``TRITON_INTERPRET=1``)."""
    if force is not None:
        return force and _kernels() is not None
    return x.is_cuda and ENABLED["layer"] and _kernels() is not None


def check_layer_kernels(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                        qk_norm: bool, hidden: int | None = None, intermediate: int | None = None) -> bool:  # fmt: skip
    """Compile and run the layer kernels once against their torch paths; on any failure use torch from now on.

    Given the model's ``hidden`` and ``intermediate`` sizes it compiles the variants the model's steps launch
    (the norms' block is the hidden size's power of two; decode writes no K/V copy, prefill does), so a cold
    Triton cache meets no further compile when the engine captures its graphs."""
    if device.type != "cuda" or _kernels() is None:
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        T, D = 3, head_dim
        H, inner = hidden or D, intermediate or D

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, generator=g).to(dtype)

        qkv, h0, d0, w, gate_up = (
            rand(T, (num_heads + 2 * num_kv_heads) * D),
            rand(T, H),
            rand(T, H),
            rand(H),
            rand(T, 2 * inner),
        )
        static = torch.tensor([[9, 0, 1, 1], [9, 5, 7, 6], [9, 2, 4, 3]], device=device)  # like the decode buffer
        pos = static[:, 1]  # strided columns, as in a decode step
        cos, sin = torch.rand(8, D, device=device).to(dtype), torch.rand(8, D, device=device).to(dtype)
        norm = (torch.rand(D, device=device).to(dtype), 1e-6) if qk_norm else None
        slots = static[:, 2]
        got = []
        for force in (True, False):
            out = []
            for need_kv in (True, False):  # prefill keeps K/V for its attention; decode only writes the cache
                kc = torch.zeros(3, 4, num_kv_heads, D, device=device, dtype=dtype)
                vc = torch.zeros_like(kc)
                q, k, v = qkv_rope_write(qkv, pos, cos, sin, norm, norm, slots, kc, vc, num_heads, num_kv_heads,
                                         need_kv, force=force)  # fmt: skip
                out += [q, kc, vc] + ([k, v] if need_kv else [])
            out += [*add_rms_norm(h0, d0, w, 1e-6, force=force), silu_mul(gate_up, force=force)]
            out.append(rms_norm(h0, w, 1e-6) if force else rms_norm_torch(h0, w, 1e-6))
            got.append([t.float() for t in out])
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        for a, b in zip(*got):
            err = (a - b).abs().max().item()
            if not err <= tol * max(1.0, b.abs().max().item()):
                raise RuntimeError(f"fused layer kernel differs from the torch path by {err}")
        return True
    except Exception:  # compile errors come in many types; any of them means "do not use them"
        logger.exception("the fused Triton layer kernels are unusable here; using the torch ops")
        ENABLED["layer"] = False
        return False


# ------------------------------------------------------------- residual + RMSNorm
def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, force: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h + delta`` (the new residual stream) and RMSNorm of it, in one kernel on CUDA. h, delta: [T, H]."""
    if not _use_triton(h, force) or weight.dtype != h.dtype:
        s = h + delta
        return s, rms_norm_torch(s, weight, eps)
    h, delta = h.contiguous(), delta.contiguous()
    s, out = torch.empty_like(h), torch.empty_like(h)
    n = h.shape[-1]
    _kernels().add_rms_norm_kernel[(h.shape[0],)](h, delta, weight, s, out, n, eps, BLOCK=_pow2(n))
    return s, out


# ---------------------------------------------------------------------- SiLU * up
def silu_mul(gate_up: torch.Tensor, force: bool | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for the fused [T, 2I] gate/up projection output -> [T, I]."""
    n = gate_up.shape[-1] // 2
    if not _use_triton(gate_up, force):
        return torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    gate_up = gate_up.contiguous()
    out = torch.empty(gate_up.shape[0], n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _kernels().silu_mul_kernel[(gate_up.shape[0], -(-n // block))](gate_up, out, n, BLOCK=block)
    return out


# --------------------------------------------- q/k norm + RoPE + KV-cache write
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE, rotate-half layout, HF's arithmetic. x: [T, H, D]; cos/sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def write_slots(cache: torch.Tensor, slot_mapping: torch.Tensor, x: torch.Tensor) -> None:
    """Scatter ``x`` [T, Hkv, D] into its cache slots (``block * block_size + offset``). Graph-safe: no host sync."""
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, x.to(cache.dtype))


def qkv_rope_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: tuple[torch.Tensor, float] | None,
    k_norm: tuple[torch.Tensor, float] | None,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    need_kv: bool,
    force: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Split the fused QKV projection [T, (Hq + 2 Hkv) D], apply the optional per-head q/k RMSNorm (Qwen3) and
    RoPE (tables cos/sin [L, D] indexed by ``positions``), write K/V into their cache slots.

    Returns q [T, Hq, D] and, when ``need_kv`` (prefill of fresh sequences), k and v [T, Hkv, D].
    ``positions`` and ``slot_mapping`` may be strided (decode passes columns of the runner's static buffer).
    One kernel on CUDA (graph-safe); the same arithmetic in torch ops elsewhere.
    """
    T = qkv.shape[0]
    D = cos.shape[-1]
    pow2 = D & (D - 1) == 0
    if not _use_triton(qkv, force) or not pow2 or (q_norm is not None and q_norm[0].dtype != qkv.dtype):
        q, k, v = qkv.view(T, num_heads + 2 * num_kv_heads, D).split([num_heads, num_kv_heads, num_kv_heads], 1)
        if q_norm is not None and k_norm is not None:
            q, k = rms_norm_torch(q, *q_norm), rms_norm_torch(k, *k_norm)
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        q, k = _rotate(q, c, s), _rotate(k, c, s)
        write_slots(k_cache, slot_mapping, k)
        write_slots(v_cache, slot_mapping, v)
        return q, (k if need_kv else None), (v.contiguous() if need_kv else None)
    qkv = qkv.contiguous()
    q = torch.empty(T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(T, num_kv_heads, D, dtype=qkv.dtype, device=qkv.device) if need_kv else q
    v = torch.empty(T, num_kv_heads, D, dtype=qkv.dtype, device=qkv.device) if need_kv else q
    qn = q_norm[0] if q_norm is not None else cos
    kn = k_norm[0] if k_norm is not None else cos
    eps = q_norm[1] if q_norm is not None else 0.0
    heads = num_heads + 2 * num_kv_heads
    block = min(_pow2(heads), max(1, ROPE_BLOCK_VALUES // D))  # heads per program: a token's all, up to 4,096 values
    _kernels().qkv_rope_kernel[(T, -(-heads // block))](
        qkv, positions, cos, sin, qn, kn, slot_mapping, q, k, v, k_cache, v_cache, eps,
        positions.stride(0), slot_mapping.stride(0),
        NQ=num_heads, NKV=num_kv_heads, D=D, HEADS=block, QK_NORM=q_norm is not None, STORE_KV=need_kv, num_warps=4,
    )  # fmt: skip
    return q, (k if need_kv else None), (v if need_kv else None)

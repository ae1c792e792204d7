"""The Triton programs of ``fused.py`` (imported by it on the first CUDA use, or by tests under
``TRITON_INTERPRET=1``): RMSNorm, residual add + RMSNorm, SiLU * up, and q/k norm + RoPE + KV-cache write.
``fused.py`` holds the launches and the same arithmetic in torch."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)  # HF: cast back, then scale
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def add_rms_norm_kernel(h_ptr, d_ptr, w_ptr, h_out_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    h = tl.load(h_ptr + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    s = (h + d).to(h_out_ptr.dtype.element_ty)  # the residual add rounds to the model dtype, as in HF
    tl.store(h_out_ptr + row * n_cols + cols, s, mask=ok)
    x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)  # product in fp32, rounded once: torch's
    tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # silu rounds, then the product
    tl.store(out_ptr + row * n_cols + cols, (a * u).to(out_ptr.dtype.element_ty), mask=ok)


# not specialized on the position/slot columns' layout: a check's small buffer compiles the decode step's variant
@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr", "stride_pos", "stride_slot"])
def qkv_rope_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, slot_ptr,
    q_out_ptr, k_out_ptr, v_out_ptr, k_cache_ptr, v_cache_ptr,
    eps, stride_pos, stride_slot, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr,
    QK_NORM: tl.constexpr, STORE_KV: tl.constexpr,
):  # fmt: skip
    """One program per (token, block of ``HEADS`` heads) over the [q heads, k heads, v heads] of the fused row: a
    program per head did 128 values of work and cost more to schedule than to run (``fused.ROPE_BLOCK_VALUES``)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    d = tl.arange(0, D)
    half: tl.constexpr = D // 2
    partner = (d + half) % D
    is_q = h < NQ
    is_k = (h >= NQ) & (h < NQ + NKV)
    is_v = (h >= NQ + NKV) & (h < NQ + 2 * NKV)
    ok = (is_q | is_k | is_v)[:, None]
    row = qkv_ptr + t * (NQ + 2 * NKV) * D + h[:, None] * D
    dt = q_out_ptr.dtype.element_ty
    raw = tl.load(row + d[None, :], mask=ok, other=0.0)
    x = raw.to(tl.float32)
    xp = tl.load(row + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3: RMSNorm per head, HF arithmetic (fp32 normalise, cast, scale in dtype)
        w = tl.where(
            is_q[:, None], tl.load(qn_ptr + d)[None, :].to(tl.float32), tl.load(kn_ptr + d)[None, :].to(tl.float32)
        )
        wp = tl.where(
            is_q[:, None],
            tl.load(qn_ptr + partner)[None, :].to(tl.float32),
            tl.load(kn_ptr + partner)[None, :].to(tl.float32),
        )
        rs = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        x = (w * (x * rs).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        xp = (wp * (xp * rs).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + t * stride_pos)
    c = tl.load(cos_ptr + pos * D + d).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * D + d).to(tl.float32)[None, :]
    rot = tl.where(d[None, :] < half, -xp, xp)
    y = ((x * c).to(dt).to(tl.float32) + (rot * s).to(dt).to(tl.float32)).to(dt)  # HF: each op rounds
    tl.store(q_out_ptr + (t * NQ + h[:, None]) * D + d[None, :], y, mask=is_q[:, None])
    slot = tl.load(slot_ptr + t * stride_slot)  # decode reads columns of the runner's static [B, 4+n] buffer
    kh = (h - NQ)[:, None]  # the K head of a K row
    vh = (h - NQ - NKV)[:, None]  # the V head of a V row (V is copied as is)
    at = slot * NKV * D + d[None, :]
    tl.store(k_cache_ptr + at + kh * D, y.to(k_cache_ptr.dtype.element_ty), mask=is_k[:, None])
    tl.store(v_cache_ptr + at + vh * D, raw.to(v_cache_ptr.dtype.element_ty), mask=is_v[:, None])
    if STORE_KV:
        tl.store(k_out_ptr + (t * NKV + kh) * D + d[None, :], y, mask=is_k[:, None])
        tl.store(v_out_ptr + (t * NKV + vh) * D + d[None, :], raw, mask=is_v[:, None])

"""The Triton programs of ``sample_kernel.py`` (imported by it on the first CUDA use, or by tests under
``TRITON_INTERPRET=1``): the per-slice pass and the per-row combine. ``sample_kernel.py`` documents the
algorithm and launches them."""

from __future__ import annotations

import triton
import triton.language as tl

_NO_KEY = tl.constexpr(-(2**63))  # below every candidate key: removed or out-of-range lanes


@triton.jit
def _mix32(x):
    """int64 values < 2**32 -> 32-bit finaliser; products wrap, their low 32 bits are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _mix32_u32(x):
    """:func:`_mix32` on uint32 lanes: the same bits, with native wrapping 32-bit multiplies (cheap per token)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit(do_not_specialize=["B", "N"])  # one compiled variant per slice size, whatever B and top-N
def slice_kernel(
    logits_ptr, stride_row, temp_ptr, meta_ptr, rand_ptr, part_f_ptr, part_i_ptr, part_k_ptr,
    V, B, S, N, BLOCK: tl.constexpr, G: tl.constexpr, R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    mode = tl.load(meta_ptr + 3 * B + row)
    lo = tl.load(meta_ptr + row)
    hi = tl.load(meta_ptr + B + row)
    pos = tl.load(meta_ptr + 2 * B + row)
    key = _mix32(lo ^ _mix32(hi ^ 0x9E3779B9))
    key = _mix32(key ^ _mix32((pos + 0x85EBCA6B) & 0xFFFFFFFF))
    if mode == 1:
        key = tl.load(rand_ptr + row) & 0xFFFFFFFF
    key32 = key.to(tl.uint32)
    first = split * BLOCK
    cols = first + tl.arange(0, R)[:, None] * G + tl.arange(0, G)[None, :]  # [R, G]: the slice, G per group
    ok = cols < V
    base = logits_ptr + row.to(tl.int64) * stride_row
    x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
    if temp != 1.0:  # x / 1.0 is x: the IEEE division (as torch's) is skipped at the common temperature
        x = tl.div_rn(x, temp)
    m = tl.max(tl.max(x, axis=1), axis=0)
    s = tl.sum(tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - m)), axis=1), axis=0)
    if mode == 0:
        score = x
    else:
        tok = _mix32_u32(cols.to(tl.uint32) + 0x27D4EB2F)
        bits = _mix32_u32(key32 ^ tok)
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        e = tl.maximum(-tl.log(u), 1.1754943508222875e-38)
        score = tl.where(x == float("-inf"), float("-inf"), x - tl.log(e))
    top = tl.max(tl.max(score, axis=1), axis=0)
    idx = tl.min(tl.min(tl.where(score == top, cols, 2147483647), axis=1), axis=0)  # lowest among equals
    x_at = tl.max(tl.max(tl.where(cols == idx, x, float("-inf")), axis=1), axis=0)
    off = row * S + split
    tl.store(part_f_ptr + off, m)
    tl.store(part_f_ptr + B * S + off, s)
    tl.store(part_f_ptr + 2 * B * S + off, top)
    tl.store(part_f_ptr + 3 * B * S + off, x_at)
    tl.store(part_i_ptr + off, idx)
    if N > 0:  # top-N candidates: the best key of each group of G columns (see the module docstring)
        gx = tl.max(x, axis=1)  # [R]
        gi = tl.min(tl.where(x == gx[:, None], cols, 2147483647), axis=1)
        # the key, inline (a nested jit call costs milliseconds under TRITON_INTERPRET): the value's bits as
        # an order-preserving int32 (+ 0.0: -0.0 ties with +0.0, as in torch) above 2**31 - 1 - id
        b = (gx + 0.0).to(tl.int32, bitcast=True)
        heads = ((b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (2147483647 - gi).to(tl.int64)
        tl.store(part_k_ptr + row * S * R + split * R + tl.arange(0, R), tl.where(gi < V, heads, _NO_KEY))


@triton.jit(do_not_specialize=["B", "S", "N", "NG"])  # one compiled variant per vocabulary (see combine_widths)
def combine_kernel(
    logits_ptr, stride_row, temp_ptr, part_f_ptr, part_i_ptr, part_k_ptr, out_tok_ptr, out_lse_ptr, packed_ptr,
    V, B, S, N, NG, S_P: tl.constexpr, G: tl.constexpr, NG_P: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    sp = tl.arange(0, S_P)
    ok = sp < S
    off = row * S + sp
    m = tl.load(part_f_ptr + off, mask=ok, other=float("-inf"))
    s = tl.load(part_f_ptr + B * S + off, mask=ok, other=0.0)
    mx = tl.max(m, axis=0)
    total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mx)), axis=0)
    lse = mx + tl.log(total)
    score = tl.load(part_f_ptr + 2 * B * S + off, mask=ok, other=float("-inf"))
    x_at = tl.load(part_f_ptr + 3 * B * S + off, mask=ok, other=float("-inf"))
    idx = tl.load(part_i_ptr + off, mask=ok, other=2147483647)
    top = tl.max(score, axis=0)
    win = tl.min(tl.where(score == top, idx, 2147483647), axis=0)
    x_win = tl.max(tl.where((score == top) & (idx == win), x_at, float("-inf")), axis=0)
    tl.store(out_tok_ptr + row, win.to(tl.int64))
    tl.store(out_lse_ptr + row, lse)
    tl.store(packed_ptr + row, win.to(tl.float64))
    tl.store(packed_ptr + B + row, (x_win - lse).to(tl.float64))
    if N > 0:
        # the row's group heads (group g = columns g*G .. g*G+G-1); a round takes the best head and refills
        # it from the group's G logits read again, without the keys already taken (those >= the best)
        temp = tl.load(temp_ptr + row)
        base = logits_ptr + row.to(tl.int64) * stride_row
        groups = tl.arange(0, NG_P)
        heads = tl.load(part_k_ptr + row * NG + groups, mask=groups < NG, other=_NO_KEY)
        lanes = tl.arange(0, G)
        for j in range(N):
            best = tl.max(heads, axis=0)
            hi32 = (best >> 32).to(tl.int32)
            value = (hi32 ^ ((hi32 >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
            token = 2147483647 - (best & 2147483647)
            tl.store(packed_ptr + 2 * B + row * N + j, token.to(tl.float64))
            tl.store(packed_ptr + 2 * B + B * N + row * N + j, (value - lse).to(tl.float64))
            g = tl.where(best == _NO_KEY, 0, token // G).to(tl.int32)
            gc = g * G + lanes  # [G]
            okg = gc < V
            xg = tl.div_rn(tl.load(base + gc, mask=okg, other=float("-inf")).to(tl.float32), temp)
            bg = (xg + 0.0).to(tl.int32, bitcast=True)
            kg = ((bg ^ ((bg >> 31) & 0x7FFFFFFF)).to(tl.int64) << 32) | (2147483647 - gc).to(tl.int64)
            kg = tl.where(okg & (kg < best), kg, _NO_KEY)
            heads = tl.where(groups == g, tl.max(kg, axis=0), heads)

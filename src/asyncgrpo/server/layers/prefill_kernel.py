"""Triton paged-attention kernel for row-wise prefill: tiles of consecutive query rows of one sequence.

Row-wise prefill (``engine/row_prefill.py``) gives every new token its own row. The decode kernel would read a
sequence's context once per row; here one program takes a *tile* of up to ``BLOCK_M`` consecutive rows
of one sequence (positions p, p+1, ...) with the query heads of one KV head, so each K/V tile is read
once per query tile. Row ``m`` of a tile attends to cache positions ``< ctx[m]`` (its position + 1),
which makes it causal. A tile is ``(first row, number of rows)``; tiles with zero rows do nothing, so a
captured CUDA graph keeps a fixed grid. Runs on CPU under ``TRITON_INTERPRET=1`` for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from asyncgrpo.server.layers.prefill_tiles import tile_rows


@triton.jit(do_not_specialize=["table_ptr", "ctx_ptr", "stride_tb", "stride_cb"])  # as the decode kernel
def _paged_prefill_kernel(
    q_ptr,  # [R, Hq, D]
    k_ptr,  # [num_blocks, block_size, Hkv, D]
    v_ptr,
    out_ptr,  # [R, Hq, D]
    table_ptr,  # [R, max_blocks]: every row of a tile holds its sequence's table; the first row's is read
    ctx_ptr,  # [R]: position + 1
    tile_ptr,  # [num_tiles, 2] int64: first row, number of rows (0: nothing to do)
    scale,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_tb,
    stride_cb,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    first = tl.load(tile_ptr + tile * 2)
    n_rows = tl.load(tile_ptr + tile * 2 + 1)
    if n_rows > 0:
        i = tl.arange(0, BLOCK_M * G_PAD)  # query row i: sequence row i // G_PAD, head i % G_PAD of the group
        m = i // G_PAD
        g = i % G_PAD
        ok = (m < n_rows) & (g < GROUP)
        row = first + m
        d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + row[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=ok[:, None],
                    other=0.0)  # fmt: skip
        ctx = tl.load(ctx_ptr + row * stride_cb, mask=ok, other=0)  # [QR]
        last_ctx = tl.load(ctx_ptr + (first + n_rows - 1) * stride_cb)  # the tile's longest context
        mx = tl.full([BLOCK_M * G_PAD], float("-inf"), dtype=tl.float32)
        l_sum = tl.zeros([BLOCK_M * G_PAD], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M * G_PAD, HEAD_DIM], dtype=tl.float32)
        for start in range(0, last_ctx, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            t_ok = t < last_ctx
            block = tl.load(table_ptr + first * stride_tb + t // BLOCK_SIZE, mask=t_ok, other=0)
            kv_row = block.to(tl.int64) * stride_kb + (t % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
            k = tl.load(k_ptr + kv_row[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)  # [BLOCK_N, D]
            v = tl.load(v_ptr + kv_row[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(t[None, :] < ctx[:, None], s * scale, float("-inf"))  # causal: own position and before
            m_new = tl.maximum(mx, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded query rows see no key at all
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(mx - m_safe)
            l_sum = l_sum * alpha + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            mx = m_new
        out = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        tl.store(out_ptr + row[:, None] * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=ok[:, None])  # fmt: skip


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """Causal attention of row-wise prefill tokens over the paged cache. q: [R, Hq, D] -> [R, Hq, D].

    Rows outside every tile (padding rows) come out as zeros. No host sync (graph-safe).
    """
    _, Hq, D = q.shape
    _, block_size, Hkv, Dk = k_cache.shape
    assert D == Dk and Hq % Hkv == 0 and D == triton.next_power_of_2(D), "head_dim must be a power of two"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    assert block_tables.stride(1) == 1 and tiles.is_contiguous() and tiles.shape[1] == 2
    group = Hq // Hkv
    out = torch.zeros_like(q)
    _paged_prefill_kernel[(tiles.shape[0], Hkv)](
        q, k_cache, v_cache, out, block_tables, context_lens, tiles, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), context_lens.stride(0), out.stride(0), out.stride(1),
        GROUP=group, G_PAD=triton.next_power_of_2(group), BLOCK_M=tile_rows(group), HEAD_DIM=D,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, IEEE=q.dtype == torch.float32, num_warps=num_warps,
    )  # fmt: skip
    return out

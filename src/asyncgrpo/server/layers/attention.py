"""Attention over the paged KV cache: cache writes, packed prefill, batched decode.

Cache layout per layer: K and V each ``[num_blocks + 1, block_size, num_kv_heads, head_dim]``;
the extra last block is a sink that padded CUDA-graph rows write into and read
from, never handed to a sequence. A token's *slot* is ``block * block_size + offset``.

Prefill of fresh sequences attends within the new tokens, with no cache reads: on CUDA ``torch.nn.attention.varlen.varlen_attn``
(FlashAttention inside torch) over the packed batch when present, else one causal
SDPA per sequence. The uncached tail of a sequence that reuses a cached prefix
runs as decode queries, one per token. Decode reads the cache: on CUDA the Triton kernel of
:mod:`decode_kernel`, elsewhere a gather + masked SDPA in torch.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from asyncgrpo.triton_support import load_kernels

if TYPE_CHECKING:
    from asyncgrpo.server.models.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- prefill
@functools.cache
def _varlen_kwargs() -> dict | None:
    """How this torch's varlen_attn spells 'causal' and GQA, or None when it is absent."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    out: dict = {"fn": varlen_attn, "gqa": "enable_gqa" in params}
    if "window_size" in params:
        out["causal"] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        out["causal"] = {"is_causal": True}
    else:
        return None
    out["scale"] = "scale" in params
    return out


# fast paths switched off for the whole process once they fail on this machine (logged once)
ENABLED = {"varlen": True, "triton": True}


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a packed prefill batch. q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D].

    Fresh sequences attend within their own tokens; tokens of sequences with a cached prefix
    (``batch.row_idx``) read their whole context from the cache, where this layer's K/V already is.
    """
    if batch.row_idx is None:
        return _prefill_fresh(q, k, v, batch, scale)
    out = torch.empty_like(q)
    if batch.fresh_idx is not None:
        fi = batch.fresh_idx
        out[fi] = _prefill_fresh(q[fi], k[fi], v[fi], batch, scale)
    out[batch.row_idx] = decode_attention(q[batch.row_idx], k_cache, v_cache, batch, scale)
    return out


def _prefill_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, scale: float):
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and ENABLED["varlen"]:
        spec = _varlen_kwargs()
        if spec is not None:
            try:
                return _prefill_varlen(q, k, v, batch, scale, spec)
            except RuntimeError:
                logger.exception("varlen_attn failed; using per-sequence SDPA for prefill from now on")
                ENABLED["varlen"] = False
    return _prefill_sdpa(q, k, v, batch.seq_lens, scale)


def _prefill_varlen(q, k, v, batch: ForwardBatch, scale: float, spec: dict) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    kwargs = dict(spec["causal"])
    if spec["gqa"]:
        kwargs["enable_gqa"] = True
    elif group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    if spec["scale"]:
        kwargs["scale"] = scale
    cu = batch.cu_seqlens
    return spec["fn"](q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, **kwargs)


def _prefill_sdpa(q, k, v, seq_lens: list[int], scale: float) -> torch.Tensor:
    out = torch.empty_like(q)
    start = 0
    for n in seq_lens:
        qs = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
        ks = k[start : start + n].transpose(0, 1)
        vs = v[start : start + n].transpose(0, 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[start : start + n] = o.transpose(0, 1)
        start += n
    return out


# ----------------------------------------------------------------------- decode
def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """One query token per sequence against its paged context. q: [B, Hq, D] -> [B, Hq, D].

    Row-wise prefill (``batch.prefill_tiles``) runs the tiled kernel: its rows are runs of consecutive
    positions of one sequence, which share their context reads."""
    if q.is_cuda and ENABLED["triton"] and batch.prefill_tiles is not None:
        from asyncgrpo.server.layers.prefill_kernel import paged_prefill

        return paged_prefill(q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.prefill_tiles, scale)
    if q.is_cuda and ENABLED["triton"]:
        from asyncgrpo.server.layers.decode_kernel import paged_decode

        return paged_decode(q, k_cache, v_cache, batch.block_tables, batch.context_lens, scale)
    return paged_decode_torch(q, k_cache, v_cache, batch.block_tables, batch.context_lens, batch.max_context_len, scale)


def paged_decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
) -> torch.Tensor:
    """Gather each sequence's blocks and run masked SDPA (CPU path; also a readable spec of the kernel)."""
    B, _, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    n_blocks = -(-max_context_len // block_size)
    table = block_tables[:, :n_blocks].long()  # [B, n_blocks]
    k = k_cache[table].reshape(B, n_blocks * block_size, Hkv, D)[:, :max_context_len]  # [B, L, Hkv, D]
    v = v_cache[table].reshape(B, n_blocks * block_size, Hkv, D)[:, :max_context_len]
    valid = torch.arange(max_context_len, device=q.device)[None, :] < context_lens[:, None].long()  # [B, L]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, D]
        k.transpose(1, 2),  # [B, Hkv, L, D]
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )
    return o.squeeze(2)


def _random_qkv(device: torch.device, dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, queries: int):
    """A 9-block cache of 16-token blocks and ``queries`` query rows, seeded: the kernels' start-up checks."""
    gen = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(9, 16, num_kv_heads, head_dim, device=device, generator=gen).to(dtype)
    v = torch.randn(9, 16, num_kv_heads, head_dim, device=device, generator=gen).to(dtype)
    q = torch.randn(queries, num_kv_heads * group, head_dim, device=device, generator=gen).to(dtype)
    return q, k, v


def _check_close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    err = (got.float() - ref).abs().max().item()
    if not err < (1e-3 if dtype == torch.float32 else 5e-2):
        raise RuntimeError(f"{what} differs from the torch reference by {err}")


def check_triton_decode(device: torch.device, dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int) -> bool:
    """Run the Triton kernel once on small random data against :func:`paged_decode_torch`.

    Compiles the kernel for this shape up front; on any failure the engine falls back
    to the torch path (without CUDA graphs) instead of failing every request.
    """
    if not ENABLED["triton"]:
        return False
    if load_kernels("asyncgrpo.server.layers.decode_kernel", "the CUDA engine's paged-attention kernels") is None:
        ENABLED["triton"] = False
        return False
    try:
        from asyncgrpo.server.layers.decode_kernel import paged_decode

        q, k, v = _random_qkv(device, dtype, num_kv_heads, group, head_dim, 3)
        tables = torch.tensor([[3, 1, 4], [0, 5, 8], [7, 2, 6]], device=device)
        lens = torch.tensor([1, 20, 48], device=device)
        ref = paged_decode_torch(q.float(), k.float(), v.float(), tables, lens, 48, head_dim**-0.5)
        _check_close(paged_decode(q, k, v, tables, lens, head_dim**-0.5), ref, dtype, "Triton decode kernel")
        return True
    except Exception:  # compile errors come in many types; any of them means "do not use it"
        logger.exception("the Triton paged-decode kernel is unusable here; falling back to torch decode without graphs")
        ENABLED["triton"] = False
        return False


def check_prefill_kernel(
    device: torch.device, dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int
) -> bool:
    """Compile the kernel for this shape and compare it once with the torch reference (rows as decode queries);
    False (logged) when it is unusable here: row-wise prefill then reads the context per row (decode kernel)."""
    if load_kernels("asyncgrpo.server.layers.prefill_kernel", "the CUDA engine's paged-attention kernels") is None:
        return False
    try:
        from asyncgrpo.server.layers.prefill_kernel import paged_prefill
        from asyncgrpo.server.layers.prefill_tiles import tile_rows

        bm = tile_rows(group)
        n = 2 * bm + 3  # one sequence over three tiles (the last one partial), then a one-row sequence
        q, k, v = _random_qkv(device, dtype, num_kv_heads, group, head_dim, n + 1)
        tables = torch.tensor([[3, 1, 4, 0, 5, 8, 7, 2, 6]] * n + [[6, 2, 7, 8, 5, 0, 4, 1, 3]], device=device)
        lens = torch.tensor(list(range(20, 20 + n)) + [5], device=device)
        tiles = torch.tensor([[0, bm], [bm, bm], [2 * bm, 3], [n, 1], [0, 0]], device=device)
        ref = paged_decode_torch(q.float(), k.float(), v.float(), tables, lens, int(lens.max()), head_dim**-0.5)
        got = paged_prefill(q, k, v, tables, lens, tiles, head_dim**-0.5)
        _check_close(got, ref, dtype, "Triton prefill kernel")
        return True
    except Exception:  # compile errors come in many types; any of them means "do not use it"
        logger.exception("the Triton paged-prefill kernel is unusable here; using the decode one")
        return False

"""Split-vocabulary Triton sampler for the common rows: temperature only, no truncation, penalties or bans.

At batch 256 and a 152 k vocabulary the torch sampler makes a dozen passes over
a [B, V] fp32 copy of the logits (upcast, log-sum-exp, noise, log, race, ...).
Here the model-dtype logits are read once, by a grid of (row, slice) programs so
that even a batch of 8 fills the GPU (one program per row left 124 of 132 SMs
idle and scanned 152 k elements serially):

1. ``_slice_kernel``: each program loads one slice of one row and writes, in
   fp32, the slice's max and normaliser of the log-sum-exp of ``x = logit / T``,
   the winner of the exponential race ``argmax(x - log E)`` (greedy rows:
   ``argmax(x)``; its score, index and ``x``) and its top-N group heads.
2. ``_combine_kernel`` (one program per row): the row's log-sum-exp, the race
   winner over the slices (lowest index among equal scores, like ``argmax``),
   its processed log-prob ``x - lse`` and the row's top-N (descending; ties:
   lower token id first) as processed log-probs, written straight into the
   float64 tensor that the sampler copies to the host in one go.

Compiled variants: one per slice size (and logits dtype); batch size and top-N
are runtime arguments (``do_not_specialize``), so :func:`warm_up` compiles all a
vocabulary needs before the first step.

Top-N without sorting: a candidate is one int64 key, the fp32 bits of ``x``
mapped to an order-preserving signed integer in the high half and
``2**31 - 1 - token`` in the low half, so one ``max`` gives the largest value
and, among equal values, the lowest token id. The slice programs only keep the
best key of each group of :data:`GROUP` columns (no loop there); the combine
program runs the N rounds once per row: take the best group head, then refill
that head from the group's logits read again, without the keys already taken.
A round costs a max over V / GROUP heads and one group, not a pass over the
vocabulary, and no slice program waits on N serial rounds. Plain ``tl`` ops
only, which also run under ``TRITON_INTERPRET``.

The noise is :func:`asyncgrpo.server.engine.sampler.hashed_exponential`'s counter hash
computed in the kernel, bit for bit (the per-row key in int64 masked to 32 bits,
the per-token hash in wrapping uint32 arithmetic), so a seeded row draws the
same ``E`` as on the torch path. Unseeded rows use a per-row 32-bit key drawn
from the engine's generator each step, hashed the same way. Runs on CPU under
``TRITON_INTERPRET=1`` for tests.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MODE_GREEDY, MODE_RANDOM_KEY, MODE_SEEDED = 0, 1, 2
MAX_TOP_N = 32  # largest top-N selected in the kernel; the sampler uses torch.topk above it (--max-logprobs is 20)
# Slice size (a power of two): the largest of 4096/2048/1024 that still gives every SM at least two programs
# (rows x slices >= 2 x SMs): batch >= 8 at V = 152 k keeps 4096 (38 slices a row), batch 1 gets 1024. A slice
# is held in registers at once, 8 columns a thread (num_warps = slice / 256: 48-60 registers on sm_90, so two
# 16-warp programs of 4096 fit an SM; at 16 columns a thread it takes 114), and the combine step holds every
# slice's partials, so a row has at most MAX_SLICES slices (the slice grows for very large vocabularies).
SLICE_SIZES = (4096, 2048, 1024)
MAX_SLICES = 256
GROUP = 64  # top-N: the slice kernel keeps each group's best candidate, V / 64 heads a row (2374 at 152 k)

if triton is not None:
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
    def _slice_kernel(
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
        x = tl.div_rn(tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32), temp)  # IEEE, as torch
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

    @triton.jit(do_not_specialize=["B", "N"])
    def _combine_kernel(
        logits_ptr, stride_row, temp_ptr, part_f_ptr, part_i_ptr, part_k_ptr, out_tok_ptr, out_lse_ptr, packed_ptr,
        V, B, S, N, S_P: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, NG_P: tl.constexpr,
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


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def choose_slice(batch: int, vocab: int, sms: int) -> int:
    """Slice size for ``batch`` rows of ``vocab`` logits on ``sms`` multiprocessors (see :data:`SLICE_SIZES`)."""
    size = SLICE_SIZES[-1]
    for size in SLICE_SIZES:
        if batch * triton.cdiv(vocab, size) >= 2 * sms:
            break
    while triton.cdiv(vocab, size) > MAX_SLICES:
        size *= 2
    return size


def fused_sample(
    logits: torch.Tensor, temps: torch.Tensor, meta: torch.Tensor, rand_keys: torch.Tensor, top_n: int = 0,
    slice_size: int | None = None, num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Sample one token per row and select each row's top-``top_n``.

    Args:
        logits: [B, V], any float dtype, unit column stride.
        temps: [B] fp32 temperatures (1.0 for greedy rows).
        meta: [4, B] int64 rows: seed low 32 bits, seed high 32 bits, output position, mode.
        rand_keys: [B] int64 keys of the ``MODE_RANDOM_KEY`` rows.
        top_n: 0..:data:`MAX_TOP_N` (K below): the top-N to select per row.
        slice_size: vocabulary slice per program, a power of two >= 64 (default: :func:`choose_slice`).
        num_warps: warps of a slice program (default: 8 columns a thread, 4 to 16 warps).

    Returns:
        (tokens [B] int64, packed float64 [2B + 2BK] = tokens, their processed log-probs, then per row the
        top-K token ids and after them their processed log-probs (row-major, descending), lse [B] fp32).
    """
    B, V = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    if not 0 <= top_n <= MAX_TOP_N:
        raise ValueError(f"top_n={top_n} is outside the kernel's 0..{MAX_TOP_N}; use torch.topk for a larger top-N")
    k = top_n
    block = slice_size or choose_slice(B, V, _sm_count(logits.device))
    assert block >= 64 and block & (block - 1) == 0, f"slice_size must be a power of two >= 64, got {block}"
    S = triton.cdiv(V, block)
    dev = logits.device
    part_f = torch.empty(4, B, S, dtype=torch.float32, device=dev)  # max, normaliser, race score, x of the winner
    part_i = torch.empty(B, S, dtype=torch.int32, device=dev)  # race winner's token id
    part_k = torch.empty(B, S * (block // GROUP) if k else 1, dtype=torch.int64, device=dev)  # group heads (keys)
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    lse = torch.empty(B, dtype=torch.float32, device=dev)
    packed = torch.empty(2 * B + 2 * B * k, dtype=torch.float64, device=dev)
    warps = num_warps or min(16, max(4, block // 256))
    R = block // GROUP
    _slice_kernel[(B, S)](logits, logits.stride(0), temps, meta, rand_keys, part_f, part_i, part_k, V, B, S, k,
                          BLOCK=block, G=GROUP, R=R, num_warps=warps)  # fmt: skip
    _combine_kernel[(B,)](logits, logits.stride(0), temps, part_f, part_i, part_k, tokens, lse, packed, V, B, S, k,
                          S_P=triton.next_power_of_2(S), G=GROUP, NG=S * R, NG_P=triton.next_power_of_2(S * R),
                          num_warps=8)  # fmt: skip
    return tokens, packed, lse


def warm_up(device: torch.device, vocab: int, dtype: torch.dtype) -> list[int]:
    """Compile every slice size :func:`choose_slice` can pick for ``vocab`` (batch 1 up to 4096), so that no
    decode step stalls on a compile later when the batch shrinks; returns those sizes."""
    sizes = sorted({choose_slice(1 << i, vocab, _sm_count(device)) for i in range(13)})
    logits = torch.zeros(2, vocab, dtype=dtype, device=device)
    meta = torch.zeros(4, 2, dtype=torch.int64, device=device)
    for size in sizes:
        fused_sample(logits, torch.ones(2, device=device), meta, meta[0], top_n=1, slice_size=size)
    return sizes


def check_kernel(device: torch.device) -> bool:
    """Compile and run the kernels once on a tiny batch (the greedy row must pick the argmax, which must also
    head its top-8); False on any failure."""
    if triton is None or device.type != "cuda":
        return False
    try:
        logits = torch.arange(300, dtype=torch.float32, device=device).remainder(97)[None].repeat(2, 1)
        meta = torch.tensor([[0, 1], [0, 0], [0, 0], [MODE_GREEDY, MODE_SEEDED]], device=device)
        tok, packed, lse = fused_sample(logits, torch.ones(2, device=device), meta, meta[0], top_n=8)
        ref = torch.logsumexp(logits[0], 0)
        top_id = packed[4].item()  # row 0's first top-8 id
        if (tok[0].item() != 96 or top_id != 96 or abs(lse[0].item() - ref.item()) > 1e-3
                or not 0 <= tok[1].item() < 300):  # fmt: skip
            raise RuntimeError(f"sampling kernel self-check failed: {tok.tolist()}, {lse.tolist()}, {top_id}")
        return True
    except Exception:
        logger.exception("the Triton sampling kernel is unusable here; using the torch sampler")
        return False

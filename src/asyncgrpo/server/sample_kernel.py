"""One-pass Triton sampler for the common rows: temperature only, no truncation, penalties or bans.

At batch 256 and a 152 k vocabulary the torch sampler makes a dozen passes over
a [B, V] fp32 copy of the logits (upcast, log-sum-exp, noise, log, race, ...),
about 1 ms per decode step. Here one program per row streams the model-dtype
logits once and keeps, in fp32, the running max and normaliser of the
log-sum-exp and the running winner of the exponential race
``argmax(x / T - log E)`` (greedy rows: ``argmax(x)``).

The noise is :func:`asyncgrpo.server.sampler.hashed_exponential`'s counter hash
computed in the kernel, bit for bit (the per-row key in int64 masked to 32 bits,
the per-token hash in wrapping uint32 arithmetic), so a
seeded row draws the same ``E`` as on the torch path. Unseeded rows use a
per-row 32-bit key drawn from the engine's generator each step, hashed the same
way. Runs on CPU under ``TRITON_INTERPRET=1`` for tests.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MODE_GREEDY, MODE_RANDOM_KEY, MODE_SEEDED = 0, 1, 2

if triton is not None:

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

    @triton.jit
    def _sample_kernel(
        logits_ptr, stride_row, temp_ptr, meta_ptr, rand_ptr, out_tok_ptr, out_f_ptr,
        V, B, BLOCK: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
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
        cols0 = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per-lane running max / sum: one reduction at the end
        s = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_x = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        base = logits_ptr + row.to(tl.int64) * stride_row
        for start in range(0, V, BLOCK):
            cols = start + cols0
            ok = cols < V
            x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32) / temp
            m_new = tl.maximum(m, x)
            s = s * tl.exp(tl.where(m_new == float("-inf"), 0.0, m - m_new)) + tl.where(
                x == float("-inf"), 0.0, tl.exp(x - m_new)
            )
            m = m_new
            if mode == 0:
                score = x
            else:
                tok = _mix32_u32(cols.to(tl.uint32) + 0x27D4EB2F)
                bits = _mix32_u32(key32 ^ tok)
                u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
                e = tl.maximum(-tl.log(u), 1.1754943508222875e-38)
                score = tl.where(x == float("-inf"), float("-inf"), x - tl.log(e))
            better = score > best  # strict: the first index wins ties, like argmax
            best = tl.where(better, score, best)
            best_x = tl.where(better, x, best_x)
            best_i = tl.where(better, cols, best_i)
        mx = tl.max(m, axis=0)
        total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mx)), axis=0)
        lse = mx + tl.log(total)
        top = tl.max(best, axis=0)
        idx = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)  # lowest index among equal scores
        x_at = tl.max(tl.where((best == top) & (best_i == idx), best_x, float("-inf")), axis=0)
        tl.store(out_tok_ptr + row, idx.to(tl.int64))
        tl.store(out_f_ptr + row, x_at - lse)
        tl.store(out_f_ptr + B + row, lse)


def fused_sample(
    logits: torch.Tensor, temps: torch.Tensor, meta: torch.Tensor, rand_keys: torch.Tensor, block: int = 2048
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one token per row. logits [B, V] (any float dtype, unit stride); temps [B] fp32 (1.0 for greedy);
    meta [4, B] int64 rows (seed low 32 bits, seed high 32 bits, output position, mode); rand_keys [B] int64.

    Returns (tokens [B] int64, processed log-prob of each token [B] fp32, log-sum-exp [B] fp32).
    """
    B, V = logits.shape
    assert logits.stride(1) == 1, "logits rows must be contiguous"
    tokens = torch.empty(B, dtype=torch.int64, device=logits.device)
    floats = torch.empty(2, B, dtype=torch.float32, device=logits.device)
    _sample_kernel[(B,)](logits, logits.stride(0), temps, meta, rand_keys, tokens, floats, V, B, BLOCK=block,
                         num_warps=8)  # fmt: skip
    return tokens, floats[0], floats[1]


def check_kernel(device: torch.device) -> bool:
    """Compile and run the kernel once on a tiny batch (greedy row must pick the argmax); False on any failure."""
    if triton is None or device.type != "cuda":
        return False
    try:
        logits = torch.arange(300, dtype=torch.float32, device=device).remainder(97)[None].repeat(2, 1)
        meta = torch.tensor([[0, 1], [0, 0], [0, 0], [MODE_GREEDY, MODE_SEEDED]], device=device)
        tok, _, lse = fused_sample(logits, torch.ones(2, device=device), meta, meta[0])
        ref = torch.logsumexp(logits[0], 0)
        if tok[0].item() != 96 or abs(lse[0].item() - ref.item()) > 1e-3 or not 0 <= tok[1].item() < 300:
            raise RuntimeError(f"sampling kernel self-check failed: {tok.tolist()}, {lse.tolist()}")
        return True
    except Exception:
        logger.exception("the Triton sampling kernel is unusable here; using the torch sampler")
        return False

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

Compiled variants: one slice program per slice size and one combine program per
vocabulary (and logits dtype); batch size, top-N and the slice count are runtime
arguments (``do_not_specialize``), and the combine program's widths are sized for
the smallest slice a vocabulary can get, so :func:`warm_up` compiles all a
vocabulary needs before the first step (four compiles at 49 k, each about a second
on an empty Triton cache), and the self-check shares them.

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
``TRITON_INTERPRET=1`` for tests. The programs live in ``sample_triton.py``, imported on the first CUDA use
(a CPU install never imports Triton).
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType

import torch

from asyncgrpo.triton_support import INSTALL_HINT, load_kernels

logger = logging.getLogger(__name__)

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


def _kernels() -> ModuleType | None:
    """``sample_triton`` on first use, or None without Triton (one warning)."""
    return load_kernels("asyncgrpo.server.layers.sample_triton", "the CUDA engine's sampling kernel")


def have_kernels() -> bool:
    """Whether the Triton programs import here (their self-check is :func:`check_kernel`)."""
    return _kernels() is not None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (``triton.next_power_of_2`` without importing Triton)."""
    return 1 << max(0, n - 1).bit_length()


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def choose_slice(batch: int, vocab: int, sms: int) -> int:
    """Slice size for ``batch`` rows of ``vocab`` logits on ``sms`` multiprocessors (see :data:`SLICE_SIZES`)."""
    size = SLICE_SIZES[-1]
    for size in SLICE_SIZES:
        if batch * _cdiv(vocab, size) >= 2 * sms:
            break
    while _cdiv(vocab, size) > MAX_SLICES:
        size *= 2
    return size


def combine_widths(vocab: int, slices: int, groups: int) -> tuple[int, int]:
    """The combine program's lane counts (powers of two) for a row's slices and group heads, sized for every slice
    size :func:`choose_slice` can give ``vocab``, so that they all share one compiled combine program; never
    narrower than this call's ``slices`` and ``groups``."""
    finest = SLICE_SIZES[-1]  # the most slices a row gets: the smallest slice, grown as choose_slice grows it
    while _cdiv(vocab, finest) > MAX_SLICES:
        finest *= 2
    coarsest = max(SLICE_SIZES[0], finest)  # the most group heads: the last slice's padding is at most a slice
    most_groups = _cdiv(vocab + coarsest - 1, GROUP)
    return _pow2(max(slices, _cdiv(vocab, finest))), _pow2(max(groups, most_groups))


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
    S = _cdiv(V, block)
    dev = logits.device
    part_f = torch.empty(4, B, S, dtype=torch.float32, device=dev)  # max, normaliser, race score, x of the winner
    part_i = torch.empty(B, S, dtype=torch.int32, device=dev)  # race winner's token id
    part_k = torch.empty(B, S * (block // GROUP) if k else 1, dtype=torch.int64, device=dev)  # group heads (keys)
    tokens = torch.empty(B, dtype=torch.int64, device=dev)
    lse = torch.empty(B, dtype=torch.float32, device=dev)
    packed = torch.empty(2 * B + 2 * B * k, dtype=torch.float64, device=dev)
    warps = num_warps or min(16, max(4, block // 256))
    R = block // GROUP
    s_p, ng_p = combine_widths(V, S, S * R)
    kernels = _kernels()
    if kernels is None:
        raise RuntimeError(f"the sampling kernel needs Triton: {INSTALL_HINT}")
    kernels.slice_kernel[(B, S)](
        logits, logits.stride(0), temps, meta, rand_keys, part_f, part_i, part_k, V, B, S, k,
        BLOCK=block, G=GROUP, R=R, num_warps=warps,
    )  # fmt: skip
    kernels.combine_kernel[(B,)](
        logits, logits.stride(0), temps, part_f, part_i, part_k, tokens, lse, packed, V, B, S, k, S * R,
        S_P=s_p, G=GROUP, NG_P=ng_p, num_warps=8,
    )  # fmt: skip
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


def check_kernel(device: torch.device, vocab: int = 300, dtype: torch.dtype = torch.float32) -> bool:
    """Compile and run the kernels once on a batch of two rows of ``vocab`` logits of ``dtype`` (the greedy row
    must pick the argmax, which must also head its top-8); False on any failure. Given the model's vocabulary and
    dtype, it compiles one of the variants :func:`warm_up` needs, not one of its own."""
    if device.type != "cuda" or _kernels() is None:
        return False
    try:
        logits = torch.arange(vocab, dtype=torch.float32, device=device).remainder(97)[None].repeat(2, 1).to(dtype)
        meta = torch.tensor([[0, 1], [0, 0], [0, 0], [MODE_GREEDY, MODE_SEEDED]], device=device)
        tok, packed, lse = fused_sample(logits, torch.ones(2, device=device), meta, meta[0], top_n=8)
        ref = torch.logsumexp(logits[0].float(), 0)
        top_id = packed[4].item()  # row 0's first top-8 id
        if (tok[0].item() != 96 or top_id != 96 or abs(lse[0].item() - ref.item()) > 1e-3 * max(1.0, ref.item())
                or not 0 <= tok[1].item() < vocab):  # fmt: skip
            raise RuntimeError(f"sampling kernel self-check failed: {tok.tolist()}, {lse.tolist()}, {top_id}")
        return True
    except Exception:
        logger.exception("the Triton sampling kernel is unusable here; using the torch sampler")
        return False

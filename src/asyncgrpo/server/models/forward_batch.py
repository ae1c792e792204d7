"""The attention metadata of one engine forward: shared by the model, the attention paths and the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class ForwardBatch:
    """Attention metadata for one forward over a packed token batch.

    Prefill: ``cu_seqlens`` [N+1] int32 bounds the N *fresh* sequences (nothing
    cached, start at position 0). When some sequences reuse a cached prefix,
    ``fresh_idx`` holds the packed indices of the fresh sequences' tokens and
    ``row_idx`` those of the others; each such token attends like a decode query
    (its K/V is in the cache before attention runs), with its own row of
    ``block_tables``/``context_lens`` (context = its position + 1). Decode: one
    token per sequence, ``block_tables`` [B, max_blocks] and ``context_lens`` [B]
    (tokens in cache *including* the one being decoded). ``slot_mapping`` [T]
    int64 says where each token's K/V goes in the flattened cache.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    seq_lens: list[int] = field(default_factory=list)
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    max_context_len: int = 0
    fresh_idx: torch.Tensor | None = None
    row_idx: torch.Tensor | None = None
    # prefix caching: per layer, after this step's K/V writes, block copy_src[i] is copied onto copy_dst[i]
    copy_src: torch.Tensor | None = None
    copy_dst: torch.Tensor | None = None
    # row-wise prefill: [num_tiles, 2] (first row, rows) runs of one sequence's consecutive rows (prefill_kernel.py)
    prefill_tiles: torch.Tensor | None = None
    # LoRA: (adapter, token indices [n] int64) per adapter used in this batch; None = base model only.
    lora_groups: list[tuple[object, torch.Tensor]] | None = None


def staged_int64(shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """A static int64 device buffer (what a CUDA graph reads), its host twin and a numpy view of the twin.

    The host fills the twin through the numpy view (cheap per-row writes) and copies it over with
    ``non_blocking=True``; on CUDA the twin is pinned so that copy does not wait for the host.
    """
    on_device = torch.zeros(shape, dtype=torch.int64, device=device)
    host = torch.zeros(shape, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return on_device, host, host.numpy()

"""Paged KV cache: the per-layer K/V tensors, a free list of blocks, and the capacity rule.

Capacity (``num_blocks * block_size`` tokens):
- ``kv_cache_tokens`` given: that many tokens, rounded up to whole blocks.
- CUDA: ``gpu_memory_utilization * total`` minus what is already in use on the
  device (weights, other processes) minus headroom for activations, logits,
  the sampler and CUDA graphs (:func:`activation_headroom_bytes`).
- CPU: ``max_num_seqs * max_model_len`` tokens, capped at :data:`CPU_KV_CACHE_BYTES`
  (the cache is zero-filled host memory), and never below ``max_model_len``.
"""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB of host memory for K+V of all layers by default
GRAPH_HEADROOM_BYTES = 512 << 20  # CUDA graph pools, allocator fragmentation, cuBLAS workspaces


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token over all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def activation_headroom_bytes(
    hidden: int, intermediate: int, vocab: int, max_batched_tokens: int, max_num_seqs: int, elem: int
) -> int:
    """A generous bound on transient memory of one step (prefill activations + fp32 sampler rows)."""
    per_token = (6 * hidden + 3 * intermediate) * elem
    sampler = 6 * max_num_seqs * vocab * 4  # fp32 logits, log-probs, noise, sort values/indices
    return max_batched_tokens * per_token + sampler + GRAPH_HEADROOM_BYTES


def plan_num_blocks(
    *,
    block_size: int,
    bytes_per_token: int,
    device: torch.device,
    kv_cache_tokens: int | None,
    gpu_memory_utilization: float,
    max_num_seqs: int,
    max_model_len: int,
    headroom_bytes: int,
) -> int:
    """Number of KV blocks per the module docstring's rule."""
    if kv_cache_tokens is not None:
        if kv_cache_tokens <= 0:
            raise ValueError(f"kv_cache_tokens must be positive, got {kv_cache_tokens}")
        return math.ceil(kv_cache_tokens / block_size)
    if device.type == "cuda":
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_memory_utilization * total - (total - free) - headroom_bytes
        tokens = int(budget // bytes_per_token)
        if tokens < max_model_len:
            raise ValueError(
                f"only {max(tokens, 0)} KV-cache tokens fit in gpu_memory_utilization={gpu_memory_utilization} "
                f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB); raise gpu_memory_utilization, "
                f"lower max_model_len ({max_model_len}) or pass kv_cache_tokens"
            )
        # never more than every sequence at full length could use
        tokens = min(tokens, max_num_seqs * max_model_len)
        return tokens // block_size
    tokens = min(max_num_seqs * max_model_len, CPU_KV_CACHE_BYTES // bytes_per_token)
    return math.ceil(max(tokens, max_model_len) / block_size)


class KVCache:
    """The per-layer K/V tensors plus a free list; block ``num_blocks`` is the padding sink."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_block = num_blocks
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        # zero-filled: masked reads of never-written slots must stay finite (0 * NaN would be NaN)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        """Extra blocks a sequence holding ``have`` blocks needs to store ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, n: int) -> list[int]:
        assert n <= len(self._free), "caller checks num_free first"
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
        blocks.clear()

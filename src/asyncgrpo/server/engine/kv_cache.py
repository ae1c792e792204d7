"""Paged KV cache: the per-layer K/V tensors, a free list of blocks, and the capacity rule.

Capacity (``num_blocks * block_size`` tokens):
- ``kv_cache_tokens`` given: that many tokens, rounded up to whole blocks.
- Otherwise never more than can be in flight: ``max_num_seqs`` sequences of
  ``max_model_len`` tokens, each in whole blocks. A cache beyond that is never
  used, and on a GPU shared with a trainer it is memory the trainer lacks.
- CUDA: at most ``gpu_memory_utilization * total`` minus what is already in use
  on the device (weights, other processes) minus headroom for activations,
  logits, the sampler and CUDA graphs (:func:`activation_headroom_bytes`).
- CPU: at most :data:`CPU_KV_CACHE_BYTES` (the cache is zero-filled host
  memory), and never below ``max_model_len``.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict

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
) -> tuple[int, str]:
    """Number of KV blocks per the module docstring's rule, and why that many (for the engine's ready line)."""
    if kv_cache_tokens is not None:
        if kv_cache_tokens <= 0:
            raise ValueError(f"kv_cache_tokens must be positive, got {kv_cache_tokens}")
        return math.ceil(kv_cache_tokens / block_size), f"kv_cache_tokens {kv_cache_tokens}"
    # what can be in flight: every sequence at full length, each in whole blocks
    need = max_num_seqs * math.ceil(max_model_len / block_size)
    in_flight = f"max_num_seqs {max_num_seqs} x max_model_len {max_model_len}"
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
        return size_to_need(need, tokens // block_size, block_size, in_flight,
                            f"gpu_memory_utilization {gpu_memory_utilization}")  # fmt: skip
    cap = math.ceil(max(CPU_KV_CACHE_BYTES // bytes_per_token, max_model_len) / block_size)
    return size_to_need(need, cap, block_size, in_flight, f"CPU cache's {CPU_KV_CACHE_BYTES >> 20} MiB")


def size_to_need(need_blocks: int, limit_blocks: int, block_size: int, in_flight: str, limit: str) -> tuple[int, str]:
    """The smaller of what can be in flight and what the memory limit allows, and the reason in words."""
    if need_blocks <= limit_blocks:
        return need_blocks, f"{in_flight} (the {limit} would allow {limit_blocks * block_size})"
    return limit_blocks, f"the {limit} ({in_flight} would need {need_blocks * block_size})"


class KVCache:
    """The per-layer K/V tensors plus the block pool; block ``num_blocks`` is the padding sink.

    Blocks are reference-counted. With ``enable_prefix_caching`` a *full* block
    can carry a key, the chained hash of (parent key, its token ids, adapter key),
    so equal prefixes under the same adapter map to the same blocks:
    - :meth:`lookup` takes a reference on the longest run of cached blocks;
    - :meth:`register` keys freshly allocated blocks (their K/V is written by the
      step that scheduled them, before any later attention reads them);
    - the block holding a prompt's last token is never shared (the last token is
      recomputed for its logits, and its owner appends there); its K/V can be
      copied from a cached block with the same key instead (:meth:`take`);
    - a freed keyed block stays cached and is evicted least-recently-freed first,
      only when :meth:`allocate` runs out of never-keyed free blocks;
    - :meth:`reset_prefix_cache` forgets every key (weights changed).
    Keys are Python's 64-bit tuple hashes: equal prefixes always share; a
    collision between different prefixes would need two equal 64-bit hashes.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.pad_block = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
        # zero-filled: masked reads of never-written slots must stay finite (0 * NaN would be NaN)
        self.layers = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self._free = list(range(num_blocks - 1, -1, -1))  # unkeyed free blocks; pop() hands out low ids first
        self._ref = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # key -> block
        self._evictable: OrderedDict[int, None] = OrderedDict()  # keyed blocks with no reference, LRU first

    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out (unkeyed free + cached blocks nobody references)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int, have: int) -> int:
        """Extra blocks a sequence holding ``have`` blocks needs to store ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - have)

    def allocate(self, n: int) -> list[int]:
        assert n <= self.num_free, "caller checks num_free first"
        out = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()
            else:  # evict the least recently freed cached block
                block, _ = self._evictable.popitem(last=False)
                del self._cached[self._key[block]]  # type: ignore[index]
                self._key[block] = None
            self._ref[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference per block (tail first, so a sequence's last blocks are evicted first)."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if self._key[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None
        blocks.clear()

    # ---------------------------------------------------------- prefix caching
    def block_keys(self, token_ids: list[int], adapter_key: int | None) -> list[int]:
        """Chained keys of every block of ``token_ids``, the last one possibly partial.

        A partial block's key covers only the tokens it holds now; a full-block lookup (always 16-token tuples)
        never matches it, so a block its owner still appends to is only ever *copied* (:meth:`take`), never shared.
        """
        bs, parent, keys = self.block_size, adapter_key, []
        for i in range(-(-len(token_ids) // bs)):
            parent = hash((parent, adapter_key, tuple(token_ids[i * bs : (i + 1) * bs])))
            keys.append(parent)
        return keys

    def take(self, key: int) -> int | None:
        """The cached block of ``key`` with one more reference (to copy from), or None."""
        hit = self.lookup([key])
        return hit[0] if hit else None

    def lookup(self, keys: list[int]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys``, each with one more reference."""
        hit = []
        for key in keys:
            block = self._cached.get(key)
            if block is None:
                break
            if self._ref[block] == 0:
                del self._evictable[block]
            self._ref[block] += 1
            hit.append(block)
        return hit

    def register(self, blocks: list[int], keys: list[int]) -> None:
        """Key full blocks whose K/V this step writes; a key already cached keeps its first block."""
        if not self.enable_prefix_caching:
            return
        for block, key in zip(blocks, keys):
            if key not in self._cached and self._key[block] is None:
                self._cached[key] = block
                self._key[block] = key

    def reset_prefix_cache(self) -> None:
        """Forget every key: cached free blocks become plain free blocks, used ones stay with their owners."""
        for block in self._evictable:
            self._free.append(block)
        self._evictable.clear()
        for block in self._cached.values():
            self._key[block] = None
        self._cached.clear()

"""Small prefills as one CUDA-graph replay: every new token is a decode-style row.

An eager prefill costs one Python dispatch per kernel, about 300 launches for a 28-layer model: 15-30 ms
on an H200 however few tokens it holds. In a GRPO run most prefills are small (a group's prompt, and
the last token of the G-1 requests that reuse its cached prefix), and with a small model that launch
cost made prefill about 40 % of the server's busy time.

Here a prefill of up to ``max(ROW_BUCKETS)`` tokens runs the decode forward over *rows*, one per
token: its id, position, cache slot, context length (position + 1) and its sequence's block table.
Each layer writes every row's K/V before attention, so a row reads its own sequence's earlier tokens
from the cache, causal by its context length: exactly what the cached-prefix tail already did eagerly.
The forward is captured once per row bucket; the logits are taken only at each sequence's last row.
Prefix-cache block copies (a hit on a block computed in the same step) run inside the graph from a
fixed-size list padded with sink-onto-sink copies.

Attention runs the tiled kernel of ``prefill_kernel.py`` (runs of consecutive rows of one sequence share
their context reads). Sequences longer than ``MAX_SEQ_TOKENS`` (and larger prefills) take the eager
FlashAttention path.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from asyncgrpo.server.engine.first_use import capture_at_first_use
from asyncgrpo.server.layers.attention import check_prefill_kernel
from asyncgrpo.server.layers.prefill_tiles import tile_rows
from asyncgrpo.server.models.forward_batch import ForwardBatch, staged_int64

if TYPE_CHECKING:
    from asyncgrpo.server.engine.kv_cache import KVCache
    from asyncgrpo.server.engine.scheduler import Sequence
    from asyncgrpo.server.models.decoder import DecoderLM

logger = logging.getLogger(__name__)

ROW_BUCKETS = (16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)  # token rows of the captured graphs
MAX_SEQ_TOKENS = 2048  # a longer new part prefills eagerly (FlashAttention: its tiles are larger)
MAX_COPIES = 64  # prefix-cache block copies one graph step holds (more: eager)
MAX_STAGING_BYTES = 8 << 20  # rows of the largest graph (ids, positions, slots, context lengths, block tables)
_META = 4  # columns before the block table in a row: token, position, slot, context length


class RowPrefill:
    """Static row buffers, the prefill graphs and the host-side fill of one step.

    ``logits_out`` is the decode graphs' shared logits buffer ([max_num_seqs, vocab]): a step's logits are
    its first ``len(seqs)`` rows, valid until the next graph replay (the sampler reads them first).
    """

    def __init__(self, model: DecoderLM, kv: KVCache, max_num_seqs: int, max_blocks: int, max_rows: int) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.max_num_seqs = max_num_seqs
        # Each step copies its rows to the device, block table included: at long max_model_len a row is tens of KB,
        # so the largest graph is kept to MAX_STAGING_BYTES of rows.
        max_rows = min(max_rows, max(ROW_BUCKETS[0], MAX_STAGING_BYTES // (8 * (_META + max_blocks))))
        self.buckets = [b for b in ROW_BUCKETS if b <= max_rows] or [max(1, max_rows)]
        rows = self.buckets[-1]
        self._static, self._staging, self._staging_np = staged_int64((rows, _META + max_blocks), self.device)
        # [last row of each sequence..., copy sources..., copy destinations...]
        self._meta, self._meta_staging, self._meta_np = staged_int64((max_num_seqs + 2 * MAX_COPIES,), self.device)
        self._staging_done = torch.cuda.Event() if self.device.type == "cuda" else None
        # query tiles of the tiled prefill kernel: at most rows / BLOCK_M + one partial tile per sequence
        self.tile_rows = tile_rows(model.num_heads // model.num_kv_heads)
        self.tiled = False  # set by check_kernel once the kernel passed its check
        self._tile_count = {b: b // self.tile_rows + min(b, max_num_seqs) for b in self.buckets}
        self._tiles, self._tiles_staging, self._tiles_np = staged_int64((self._tile_count[rows], 2), self.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool: object = None  # the decode graphs' memory pool, shared
        self.lazy = False  # buckets without a graph are captured after their first (eager) step
        self.logits_out: torch.Tensor | None = None
        self.enabled = False  # set once the graphs are captured (tests switch it on for the eager CPU path)
        self.steps = 0  # prefills run row-wise (diagnostics)

    # ------------------------------------------------------------------ use
    def fits(self, seqs: list[Sequence]) -> bool:
        """Whether this prefill runs row-wise: small enough, no sequence too long, few enough block copies."""
        if not self.enabled or len(seqs) > self.max_num_seqs:
            return False
        total = copies = 0
        for s in seqs:
            n = len(s.token_ids) - s.num_cached
            if n > MAX_SEQ_TOKENS:
                return False
            total += n
            copies += s.copy_src is not None
        return total <= self.buckets[-1] and copies <= MAX_COPIES

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Forward the uncached tokens of ``seqs``; logits [N, V] of each one's last token."""
        self.steps += 1
        total = sum(len(s.token_ids) - s.num_cached for s in seqs)
        rows = next(b for b in self.buckets if b >= total)
        max_ctx = self._fill(seqs, rows)
        graph = self._graphs.get(rows)
        if graph is not None:
            graph.replay()
            assert self.logits_out is not None
            logits = self.logits_out[: len(seqs)]
        else:  # eager (CPU tests, or a bucket not captured yet: this step is its warm-up)
            logits = self._forward(rows, min(rows, self.max_num_seqs), max_ctx)[: len(seqs)]
            if self.lazy:
                self._capture_lazily(rows)
        for s in seqs:
            if s.copy_src is not None:  # referenced only by this step's copy, which is queued on the stream
                self.kv.free([s.copy_src])
                s.copy_src = None
            s.num_cached = len(s.token_ids)
        return logits

    def _fill(self, seqs: list[Sequence], rows: int) -> int:
        """Write the rows and the metadata into the pinned staging buffers and copy them to the device."""
        bs, pad = self.kv.block_size, self.kv.pad_block
        if self._staging_done is not None:
            self._staging_done.synchronize()  # the previous step's copy has been read
        st, meta, tiles = self._staging_np, self._meta_np, self._tiles_np
        r = nt = 0
        bm = self.tile_rows
        copies: list[tuple[int, int]] = []
        for i, s in enumerate(seqs):
            c, n = s.num_cached, len(s.token_ids)
            table = np.asarray(s.block_table, dtype=np.int64)
            pos = np.arange(c, n, dtype=np.int64)
            end = r + n - c
            st[r:end, 0] = s.token_ids[c:]
            st[r:end, 1] = pos
            st[r:end, 2] = table[pos // bs] * bs + pos % bs
            st[r:end, 3] = pos + 1
            st[r:end, _META : _META + len(table)] = table  # entries past it are never read (context length)
            meta[i] = end - 1
            if s.copy_src is not None:
                copies.append((s.copy_src, s.block_table[(n - 1) // bs]))
            starts = np.arange(r, end, bm)
            tiles[nt : nt + len(starts), 0] = starts
            tiles[nt : nt + len(starts), 1] = np.minimum(bm, end - starts)
            nt += len(starts)
            r = end
        st[r:rows, 0 : _META + 1] = (0, 0, pad * bs, 1, pad)  # padding rows read and write only the sink block
        meta[len(seqs) : self.max_num_seqs] = 0
        src = self.max_num_seqs
        meta[src : src + 2 * MAX_COPIES] = pad  # sink onto sink
        for j, (a, b) in enumerate(copies):
            meta[src + j], meta[src + MAX_COPIES + j] = a, b
        tiles[nt : self._tile_count[rows]] = 0  # tiles without rows do nothing
        self._static[:rows].copy_(self._staging[:rows], non_blocking=True)
        self._meta.copy_(self._meta_staging, non_blocking=True)
        self._tiles[: self._tile_count[rows]].copy_(self._tiles_staging[: self._tile_count[rows]], non_blocking=True)
        if self._staging_done is not None:
            self._staging_done.record()
        return max(len(s.token_ids) for s in seqs)

    def _forward(self, rows: int, num_logits: int, max_ctx: int) -> torch.Tensor:
        st = self._static[:rows]
        src = self.max_num_seqs
        batch = ForwardBatch(
            is_prefill=False,
            slot_mapping=st[:, 2],
            block_tables=st[:, _META:],
            context_lens=st[:, 3],
            max_context_len=max_ctx,
            copy_src=self._meta[src : src + MAX_COPIES],
            copy_dst=self._meta[src + MAX_COPIES : src + 2 * MAX_COPIES],
            prefill_tiles=self._tiles[: self._tile_count[rows]] if self.tiled else None,
        )
        hidden = self.model.forward(st[:, 0], st[:, 1], batch, self.kv.layers)
        return self.model.logits(hidden.index_select(0, self._meta[:num_logits]))

    # --------------------------------------------------------------- capture
    def check_kernel(self) -> None:
        """Compile the tiled prefill kernel and check it (before serving); without it rows read per row."""
        m = self.model
        self.tiled = check_prefill_kernel(self.device, m.dtype, m.num_kv_heads, m.num_heads // m.num_kv_heads,
                                          m.head_dim)  # fmt: skip

    def capture(self, logits_out: torch.Tensor, pool: object, lazy: bool = False) -> None:
        """One graph per row bucket (largest first) in the decode graphs' pool, writing into their logits buffer;
        ``lazy``: the largest only, the others after their first step (``runner.py``). A failure leaves row-wise
        prefill off: prefills run eagerly, as before."""
        self.logits_out, self._pool = logits_out, pool
        st, meta = self._static, self._meta
        bs, pad = self.kv.block_size, self.kv.pad_block
        st[:, _META:] = pad
        st[:, 0:_META] = torch.tensor([0, 0, pad * bs, 1], device=self.device)
        meta[: self.max_num_seqs] = 0
        meta[self.max_num_seqs :] = pad
        self._tiles.zero_()
        buckets = self.buckets[-1:] if lazy else self.buckets
        try:
            self._forward(self.buckets[-1], min(self.buckets[-1], self.max_num_seqs), bs)  # warm-up (cuBLAS shapes)
            torch.cuda.synchronize(self.device)
            for rows in reversed(buckets):
                self._capture_one(rows)
            torch.cuda.synchronize(self.device)
        except Exception:  # keep serving with eager prefills
            logger.exception("prefill CUDA graph capture failed; prefilling eagerly")
            self._graphs.clear()
            return
        self.enabled, self.lazy = True, lazy
        logger.info("captured prefill CUDA graphs for %s token rows%s", buckets, " (the others at first use)" * lazy)

    @torch.no_grad()
    def _capture_one(self, rows: int) -> None:
        """Capture bucket ``rows`` (thread-local capture mode: see ``ModelRunner._capture_decode``)."""
        assert self.logits_out is not None
        n = min(rows, self.max_num_seqs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self.logits_out[:n].copy_(self._forward(rows, n, self.kv.block_size))
        self._graphs[rows] = graph

    def _capture_lazily(self, rows: int) -> None:
        self.capture_rows(rows, "at first use")

    def capture_rows(self, rows: int, when: str) -> None:
        """Capture bucket ``rows`` now (after its first eager step, or while the engine idles)."""
        capture_at_first_use(lambda: self._capture_one(rows), self.drop_graphs, f"prefill ({rows} token rows)", when)

    @property
    def lazy_rows_left(self) -> list[int]:
        """Row buckets still to be captured (ascending); empty unless graphs are on and lazy."""
        if not (self.enabled and self.lazy):
            return []
        return [r for r in self.buckets if r not in self._graphs]

    def drop_graphs(self) -> None:
        """Row-wise prefill off, its graphs released (a capture failed)."""
        self._graphs.clear()
        self.logits_out = self._pool = None
        self.enabled = self.lazy = False

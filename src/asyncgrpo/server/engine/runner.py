"""Turns a scheduled batch into model inputs and logits; owns the decode CUDA graphs.

Decode on CUDA replays a graph captured per batch-size bucket (1, 2, 4, 8, 16,
32, then every 32 up to ``max_num_seqs``). The graph reads static buffers
(token ids, positions, slot mapping, context lengths, block tables), which are
filled with one host->device copy per step; rows past the real batch point at
the KV sink block. Small prefills replay graphs of the same forward with one row
per new token (``row_prefill.py``). LoRA batches and ``enforce_eager`` run the
same forward eagerly. The sampler always runs outside the graph.

When graphs are captured (``lazy_graphs``): capturing every bucket before serving took seconds of a server's
start, and a GRPO run uses a handful of them. So at start only the largest decode bucket and the largest
prefill row count are captured (they size the one memory pool all graphs share, as when every graph is
captured largest first); any other bucket runs eagerly the first time a step needs it (that step is its
warm-up) and is captured right after, so the next step of its size replays. While the engine has nothing to
run, the buckets not captured yet are captured one at a time, smallest first (``capture_idle``: the sizes a
run meets first), so a run that grows its batch after the start rarely meets an eager step and a capture inside
its steps. ``lazy_graphs=False`` captures every bucket at start (``--cuda-graph-capture eager``).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from asyncgrpo.server.engine.first_use import capture_at_first_use
from asyncgrpo.server.engine.kv_cache import KVCache
from asyncgrpo.server.engine.row_prefill import ROW_BUCKETS, RowPrefill
from asyncgrpo.server.engine.scheduler import Sequence
from asyncgrpo.server.layers import attention, fused
from asyncgrpo.server.models.decoder import DecoderLM
from asyncgrpo.server.models.forward_batch import ForwardBatch, staged_int64

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8, 16) if b < max_num_seqs]
    sizes += list(range(32, max_num_seqs, 32))
    return sorted(set(sizes + [max_num_seqs]))


class ModelRunner:
    """Runs prefill and decode forwards of :class:`DecoderLM` against a :class:`KVCache`."""

    def __init__(
        self,
        model: DecoderLM,
        kv: KVCache,
        max_num_seqs: int,
        max_model_len: int,
        use_graphs: bool,
        max_prefill_rows: int = ROW_BUCKETS[-1],
        lazy_graphs: bool = True,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        self.max_num_seqs = max_num_seqs
        self.max_blocks = -(-max_model_len // kv.block_size)
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_logits: dict[int, torch.Tensor] = {}
        self.lazy_graphs = lazy_graphs
        self._planned: list[int] = []  # lazy: every bucket (captured or not) while capture on first use is on
        self._pool: object = None  # the memory pool all graphs share (the first captured graph's)
        self._logits: torch.Tensor | None = None  # the graphs' shared logits buffer [max_num_seqs, vocab]
        self._kernels_checked = False
        # static decode inputs, one int64 row per sequence: [token, position, slot, context_len, block table...]
        self._static, self._staging, self._staging_np = staged_int64((max_num_seqs, 4 + self.max_blocks), self.device)
        self._row_owner: list[tuple[list[int], int] | None] = [None] * max_num_seqs  # whose table each row holds
        # The H2D copy of the staging rows is asynchronous: the host must not rewrite them until it has run.
        self._staging_done = torch.cuda.Event() if self.device.type == "cuda" else None
        self.row_prefill = RowPrefill(model, kv, max_num_seqs, self.max_blocks, max_prefill_rows)

    @property
    def backend(self) -> str:
        """Which decode path runs: 'triton+cuda-graphs', 'triton-eager' or 'torch-eager'."""
        if self.device.type != "cuda" or not attention.ENABLED["triton"]:
            return "torch-eager"
        return "triton+cuda-graphs" if self._graphs else "triton-eager"

    # ------------------------------------------------------------------ prefill
    def prefill(self, seqs: list[Sequence], lora: bool = False) -> torch.Tensor:
        """Forward the uncached tokens of new sequences; returns logits [N, V] of each one's last position."""
        if not lora and self.row_prefill.fits(seqs):
            return self.row_prefill.run(seqs)
        bs = self.kv.block_size
        lens = [len(s.token_ids) - s.num_cached for s in seqs]  # tokens computed per sequence
        ids, positions, slots = [], [], []
        fresh_idx, fresh_lens, row_idx, row_seq, row_ctx, reusing = [], [], [], [], [], []
        start = 0
        for s, n in zip(seqs, lens):
            c, total = s.num_cached, len(s.token_ids)
            ids.extend(s.token_ids[c:])
            pos = np.arange(c, total, dtype=np.int64)
            positions.append(pos)
            slots.append(np.asarray(s.block_table, dtype=np.int64)[pos // bs] * bs + pos % bs)
            if c == 0:
                fresh_idx.extend(range(start, start + n))
                fresh_lens.append(n)
            else:
                row_idx.extend(range(start, start + n))
                row_seq.extend([len(reusing)] * n)
                row_ctx.extend(range(c + 1, total + 1))
                reusing.append(s)
            start += n
        cu = [0]
        for n in fresh_lens:
            cu.append(cu[-1] + n)
        dev = self.device
        batch = ForwardBatch(
            is_prefill=True,
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev, non_blocking=True),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32).to(dev, non_blocking=True),
            max_seqlen=max(fresh_lens, default=0),
            seq_lens=fresh_lens,
            lora_groups=self._lora_groups(seqs, lens) if lora else None,
        )
        if reusing:
            self._add_cached_rows(batch, reusing, fresh_idx, row_idx, row_seq, row_ctx)
        copies = [(s.copy_src, s.block_table[(len(s.token_ids) - 1) // bs]) for s in seqs if s.copy_src is not None]
        if copies:
            src, dst = zip(*copies)
            batch.copy_src = torch.tensor(src, dtype=torch.int64).to(dev, non_blocking=True)
            batch.copy_dst = torch.tensor(dst, dtype=torch.int64).to(dev, non_blocking=True)
        input_ids = torch.tensor(ids, dtype=torch.int64).to(dev, non_blocking=True)
        pos = torch.from_numpy(np.concatenate(positions)).to(dev, non_blocking=True)
        try:
            hidden = self.model.forward(input_ids, pos, batch, self.kv.layers)
        finally:
            for s in seqs:  # the copy sources were referenced only for this step
                if s.copy_src is not None:
                    self.kv.free([s.copy_src])
                    s.copy_src = None
        ends = [0]
        for n in lens:
            ends.append(ends[-1] + n)
        last = torch.tensor([e - 1 for e in ends[1:]], dtype=torch.int64).to(dev, non_blocking=True)
        for s in seqs:
            s.num_cached = len(s.token_ids)
        return self.model.logits(hidden.index_select(0, last))

    def _add_cached_rows(self, batch: ForwardBatch, reusing: list[Sequence], fresh_idx, row_idx, row_seq, row_ctx):
        """Decode-style attention metadata for the tokens of sequences that reuse a cached prefix."""
        dev = self.device
        width = max(len(s.block_table) for s in reusing)
        tables = torch.full((len(reusing), width), self.kv.pad_block, dtype=torch.int64)
        for i, s in enumerate(reusing):
            tables[i, : len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int64)
        batch.block_tables = tables[torch.tensor(row_seq)].to(dev, non_blocking=True)
        batch.context_lens = torch.tensor(row_ctx, dtype=torch.int64).to(dev, non_blocking=True)
        batch.max_context_len = max(row_ctx)
        batch.row_idx = torch.tensor(row_idx, dtype=torch.int64).to(dev, non_blocking=True)
        if fresh_idx:
            batch.fresh_idx = torch.tensor(fresh_idx, dtype=torch.int64).to(dev, non_blocking=True)

    # ------------------------------------------------------------------- decode
    def decode(self, seqs: list[Sequence], lora: bool = False, next_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """One token per sequence; returns logits [B, V] (a view of a graph buffer on the graph path).

        ``next_tokens`` (device [B]): decode one step *ahead*: each sequence's newest token is still on the
        device (sampled by the step in flight) and has not been appended to ``token_ids`` yet.
        """
        B = len(seqs)
        ahead = 0 if next_tokens is None else 1
        bucket = self._bucket(B) if (self.use_graphs and not lora) else B
        self._fill_static(seqs, bucket, ahead)
        if next_tokens is not None:
            self._static[:B, 0].copy_(next_tokens)
        if not lora and bucket in self._graphs:  # graphs hold no adapter: LoRA batches run eagerly
            self._graphs[bucket].replay()
            logits = self._graph_logits[bucket][:B]
        else:
            max_ctx = max(len(s.token_ids) for s in seqs) + ahead
            logits = self._decode_forward(bucket, max_ctx, self._lora_groups(seqs, [1] * B) if lora else None)[:B]
            if not lora and bucket in self._planned:  # first use of this bucket: the next step replays it
                self._capture_lazily(bucket)
        for s in seqs:
            s.num_cached = len(s.token_ids) + ahead
        return logits

    def _bucket(self, n: int) -> int:
        """Rows a decode of ``n`` sequences runs: the smallest bucket >= n that is captured (or, lazy, may be)."""
        for b in self._planned or sorted(self._graphs):
            if b >= n:
                return b
        return n

    def _fill_static(self, seqs: list[Sequence], rows: int, ahead: int = 0) -> None:
        bs, pad = self.kv.block_size, self.kv.pad_block
        if self._staging_done is not None:
            self._staging_done.synchronize()  # CPU-GPU sync point: the previous step's copy has been read
        st = self._staging_np  # numpy view of the (pinned) staging tensor: cheap per-row writes
        B = len(seqs)
        lens = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=B) + ahead
        if not ahead:  # ahead: the token column is filled on the device
            st[:B, 0] = [s.token_ids[-1] for s in seqs]
        st[:B, 1] = lens - 1
        st[:B, 2] = [s.block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, lens.tolist())]
        st[:B, 3] = lens
        owners = self._row_owner
        for i, s in enumerate(seqs):  # block-table rows change only when a block is added or the row changes hands
            table = s.block_table
            o = owners[i]
            if o is None or o[0] is not table or o[1] != len(table):
                st[i, 4:] = pad
                st[i, 4 : 4 + len(table)] = table
                owners[i] = (table, len(table))  # holding the list keeps its identity unique
        if rows > B:  # padding rows: read and write only the sink block
            st[B:rows, 4:] = pad
            st[B:rows, 0:4] = (0, 0, pad * bs, 1)
            owners[B:rows] = [None] * (rows - B)
        self._static[:rows].copy_(self._staging[:rows], non_blocking=True)
        if self._staging_done is not None:
            self._staging_done.record()

    def _decode_forward(
        self, rows: int, max_ctx: int, lora_groups=None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        st = self._static[:rows]
        batch = ForwardBatch(
            is_prefill=False,
            slot_mapping=st[:, 2],
            block_tables=st[:, 4:],
            context_lens=st[:, 3],
            max_context_len=max_ctx,
            lora_groups=lora_groups,
        )
        hidden = self.model.forward(st[:, 0], st[:, 1], batch, self.kv.layers)
        return self.model.logits(hidden, out)

    # ------------------------------------------------------------------- graphs
    @torch.no_grad()
    def check_kernels(self) -> None:
        """Compile the Triton kernels and check them against their torch paths (before serving: a failing one
        switches its torch path on for good, and the decode kernel's failure turns the graphs off)."""
        self._kernels_checked = True
        if self.device.type != "cuda":
            return
        m = self.model
        fused.check_layer_kernels(self.device, m.dtype, m.num_heads, m.num_kv_heads, m.head_dim,
                                  m.layers[0].q_norm is not None, m.hidden_size, m.intermediate_size)  # fmt: skip
        group = m.num_heads // m.num_kv_heads
        if not attention.check_triton_decode(self.device, m.dtype, m.num_kv_heads, group, m.head_dim):
            self.use_graphs = False  # the torch fallback needs the (host) max context length per step
        if self.use_graphs:
            self.row_prefill.check_kernel()

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """Check the kernels (unless :meth:`check_kernels` ran), then capture the decode graphs: every bucket, or
        with ``lazy_graphs`` the largest (see the module docstring). Largest first: smaller ones reuse its memory
        pool. A failure degrades to eager decoding with a logged error."""
        if not self._kernels_checked:
            self.check_kernels()
        if self.device.type != "cuda" or not self.use_graphs:
            return
        buckets = graph_buckets(self.max_num_seqs)
        try:
            self._capture(buckets[-1:] if self.lazy_graphs else buckets)
        except Exception:  # keep serving, only slower
            logger.exception("CUDA graph capture failed; decoding eagerly")
            self._drop_graphs()
            return
        if self.lazy_graphs:
            self._planned = buckets

    def _capture(self, buckets: list[int]) -> None:
        st = self._static
        st[:, 4:] = self.kv.pad_block
        st[:, 0:4] = torch.tensor([0, 0, self.kv.pad_block * self.kv.block_size, 1], device=self.device)
        warm = self._decode_forward(buckets[-1], self.kv.block_size)  # warm-up: compiles Triton, sets up cuBLAS
        # One logits buffer for every graph: each graph copies its logits into it, so a graph's own output is
        # freed into the pool after capture. Kept per graph, they cost sum(buckets) x vocab floats (~10 GB at
        # max_num_seqs 1024 with a 150k vocabulary) instead of max_num_seqs x vocab.
        self._logits = torch.empty_like(warm)
        del warm
        torch.cuda.synchronize(self.device)
        for b in reversed(buckets):
            self._capture_decode(b)
        torch.cuda.synchronize(self.device)
        logger.info("captured decode CUDA graphs for batch sizes %s%s", buckets,
                    " (the others at first use)" if self.lazy_graphs else "")  # fmt: skip
        self.row_prefill.capture(self._logits, self._pool, lazy=self.lazy_graphs)

    @torch.no_grad()  # also when a caller decodes with autograd on (tests): nothing may be saved for a backward
    def _capture_decode(self, b: int) -> None:
        """Capture bucket ``b`` into the shared pool. Thread-local capture mode: once serving, other threads of
        the engine process (weight transfer, pipe) may use CUDA meanwhile, which a global capture would refuse."""
        assert self._logits is not None
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._decode_forward(b, self.kv.block_size, out=self._logits[:b])
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[b] = graph
        self._graph_logits[b] = self._logits[:b]

    def _capture_lazily(self, b: int) -> None:
        """Capture bucket ``b`` after its first (eager) step; a failure drops every graph (eager from now on)."""
        capture_at_first_use(lambda: self._capture_decode(b), self._drop_graphs, f"decode (batch size {b})")

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._graph_logits.clear()
        self._planned, self._logits, self._pool = [], None, None
        self.use_graphs = False
        self.row_prefill.drop_graphs()

    def capture_idle(self) -> bool:
        """Capture the smallest decode bucket or prefill row count not captured yet (decode first at equal rows);
        the engine calls it when it has nothing to run. Returns whether one was captured."""
        if not self.use_graphs:
            return False
        decode = [b for b in self._planned if b not in self._graphs]
        prefill = self.row_prefill.lazy_rows_left
        if decode and (not prefill or decode[0] <= prefill[0]):
            b = decode[0]
            capture_at_first_use(lambda: self._capture_decode(b), self._drop_graphs, f"decode (batch size {b})",
                                 "while idle")  # fmt: skip
            return True
        if prefill:
            self.row_prefill.capture_rows(prefill[0], "while idle")
            return True
        return False

    @property
    def lazy_buckets_left(self) -> list[int]:
        """Diagnostics: decode buckets still to be captured at first use."""
        return [b for b in self._planned if b not in self._graphs]

    # --------------------------------------------------------------------- LoRA
    def _lora_groups(self, seqs: list[Sequence], lens: list[int]) -> list[tuple[object, torch.Tensor]] | None:
        """Token indices per adapter: sequence i owns ``lens[i]`` consecutive tokens of the batch."""
        by_adapter: dict[int, tuple[object, list[int]]] = {}
        start = 0
        for s, n in zip(seqs, lens):
            if s.lora is not None:
                by_adapter.setdefault(id(s.lora), (s.lora, []))[1].extend(range(start, start + n))
            start += n
        groups = [(a, torch.tensor(idx, dtype=torch.int64, device=self.device)) for a, idx in by_adapter.values()]
        return groups or None

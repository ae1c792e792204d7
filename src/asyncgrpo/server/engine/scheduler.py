"""Continuous batching: which sequences run in the next step.

Policy (one kind of step at a time):
- A *prefill* step admits waiting sequences in arrival order while they fit the
  per-step token budget, ``max_num_seqs`` and the free KV blocks. With prefix
  caching, a sequence first reuses the cached blocks of its longest cached
  prefix (whole blocks, never its last token) and only the rest is computed and
  counted against the budget; its own full blocks are keyed at admission, so the
  G requests of a GRPO group admitted in one step share the first one's blocks.
- A *decode* step advances every running sequence by one token.
- When both are possible the steps alternate (prefill, decode, prefill, ...), so
  a stream of arrivals can neither starve the running sequences nor wait long.
- While sequences run, waiting ones are admitted in batches: once ``max_num_seqs // 8``
  of them can be admitted at once (waiting and with a free slot), or once one has waited
  ``MAX_ADMIT_DELAY`` decode steps with a slot free. A prefill step costs a whole eager
  forward however few tokens it holds, so admitting each arrival at the next step (a GRPO
  worker sends a few new requests every step) spent a third of the engine's time in
  prefill steps, and kept the engine from decoding ahead (``core``) while anything waited.
- When a decode step finds no free block for a sequence, the newest running
  sequence is preempted by recompute: its blocks are freed and it goes back to
  the head of the waiting queue with its generated tokens (and their log-probs)
  kept; its next prefill recomputes prompt + generated tokens.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncgrpo.server.engine.kv_cache import KVCache
from asyncgrpo.server.engine.packed_top import engine_top
from asyncgrpo.server.engine.request import Request, RequestOutput, WeightVersionSpan

_arrival = itertools.count()
MAX_ADMIT_DELAY = 16  # decode steps a waiting sequence may go without a free slot being filled (~50-100 ms on a GPU)


@dataclass(eq=False)  # identity semantics: queues remove/find sequences by object, not by value
class Sequence:
    """Mutable state of one request inside the engine.

    ``token_ids`` = prompt + generated; K/V of the first ``num_cached`` of them are
    in the blocks of ``block_table``. Per-token output lists share the length of
    ``token_ids[prompt_len:]``.
    """

    request: Request
    on_finish: Callable[[RequestOutput], None]
    lora: object | None = None
    token_ids: list[int] = field(default_factory=list)
    prompt_len: int = 0
    num_cached: int = 0
    copy_src: int | None = None  # prefill only: cached block whose K/V is copied into the last-token block
    block_table: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # top-N per generated token, flat (see sampler.SampleResult): ``top_counts[i]`` entries for token i
    top_ids: list[int] | None = None
    top_values: list[float] | None = None
    top_counts: list[int] | None = None
    sampling_mask: list[list[int]] | None = None
    spans: list[WeightVersionSpan] = field(default_factory=list)
    arrival: int = field(default_factory=lambda: next(_arrival))
    sampler_row: object | None = None  # the engine loop's cached SamplerRow
    min_tokens_ban: list[int] = field(default_factory=list)
    finished: bool = False
    # [n, layers, top_k] blocks of expert ids of the tokens forwarded so far, in position order (engines that
    # capture routing: engine/routing_capture.py); a prefill from position 0 replaces them
    routed_rows: list[Any] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.request.prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        params = self.request.params
        if params.logprobs is not None:
            self.top_ids, self.top_values, self.top_counts = [], [], []
        if params.return_sampling_mask:
            self.sampling_mask = []

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def append(self, token: int, logprob: float, version: str) -> None:
        """Record one generated token and label it with the weight version in force."""
        index = len(self.token_ids) - self.prompt_len
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        spans = self.spans
        if spans:
            last = spans[-1]
            if last.version == version and last.end == index:
                last.end += 1
                return
        spans.append(WeightVersionSpan(version=version, start=index, end=index + 1))

    def to_output(self, finish_reason: str, stop_reason: int | None = None, error: str | None = None) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.request.prompt_token_ids),
            token_ids=self.output_ids,
            logprobs=list(self.logprobs),
            finish_reason=finish_reason,  # type: ignore[arg-type]
            stop_reason=stop_reason,
            top_logprobs=None
            if self.top_counts is None
            else engine_top(self.top_ids, self.top_values, self.top_counts),
            sampling_mask=self.sampling_mask,
            weight_versions=[WeightVersionSpan(s.version, s.start, s.end) for s in self.spans],
            error=error,
            routed_experts=self._routed_experts(),
        )

    def _routed_experts(self) -> Any:
        """vLLM's rows: tokens ``[start, len(token_ids) - 1)`` (the last sampled token was never forwarded; a
        decode ahead may have forwarded it, and its row is dropped)."""
        if not self.routed_rows:
            return None
        rows = np.concatenate(self.routed_rows)[: len(self.token_ids) - 1]
        return rows[self.request.params.routed_experts_prompt_start :]


def _adapter_key(seq: Sequence) -> int | None:
    """Prefix-cache key part for the sequence's adapter (loading or unloading any adapter resets the cache,
    so an adapter object's id is unique among the keys alive at once)."""
    return None if seq.lora is None else id(seq.lora)


@dataclass
class Batch:
    """The sequences of one step; a prefill sequence's first ``num_cached`` tokens are already in the cache."""

    is_prefill: bool
    seqs: list[Sequence]


class Scheduler:
    """Waiting queue, running list and the block bookkeeping that goes with them."""

    def __init__(self, kv: KVCache, max_num_seqs: int, max_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefill_tokens_computed = 0  # tokens whose K/V prefill steps computed (prompt tokens minus cache hits)
        self.prefix_cache_queries = 0  # prompt tokens looked up in the prefix cache (vLLM counts tokens)
        self.prefix_cache_hits = 0  # of those, tokens whose K/V was reused
        self._last_was_prefill = False
        self.admit_min = max(1, max_num_seqs // 8)  # admissible sequences that make a prefill step worth its cost
        self._admit_delay = 0  # decode steps taken while a waiting sequence had a free slot

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.block_table)
        seq.num_cached = 0

    def has_work(self, admit: bool) -> bool:
        return bool(self.running) or (admit and bool(self.waiting))

    def admission_due(self) -> bool:
        """Whether waiting sequences should be admitted now (see the module docstring for the batching rule)."""
        free = self.max_num_seqs - len(self.running)
        if not self.waiting or free <= 0:
            return False
        ready = min(len(self.waiting), free)
        return not self.running or ready >= self.admit_min or self._admit_delay >= MAX_ADMIT_DELAY

    def note_decode_step(self) -> None:
        """Count a finished decode step toward the admission delay (steps decoded ahead count too)."""
        if self.waiting and len(self.running) < self.max_num_seqs:
            self._admit_delay += 1

    def schedule(self, admit: bool = True) -> Batch | None:
        """The next step's batch, or None when there is nothing to do."""
        want_decode = self.running and self._last_was_prefill
        if admit and self.admission_due() and not want_decode:
            seqs = self._admit()
            if seqs:
                self._admit_delay = 0
                self._last_was_prefill = True
                return Batch(is_prefill=True, seqs=seqs)
        self._last_was_prefill = False
        if not self.running:
            return None
        return Batch(is_prefill=False, seqs=self._reserve_decode())

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.max_batched_tokens
        kv, bs = self.kv, self.kv.block_size
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = len(seq.token_ids)
            keys: list[int] = []
            hit: list[int] = []
            src, last = None, (n - 1) // bs  # the block holding the last token
            if kv.enable_prefix_caching:
                keys = kv.block_keys(seq.token_ids, _adapter_key(seq))
                hit = kv.lookup(keys[:last])  # shared blocks: never the last token's
                if len(hit) == last:
                    src = kv.take(keys[last])  # copy its K/V and compute only the last token
            reused = len(hit) * bs + (n - 1 - last * bs if src is not None else 0)
            need = kv.blocks_needed(n, len(hit))
            todo = n - reused
            if (admitted and todo > budget) or need > kv.num_free:
                kv.free(hit + ([src] if src is not None else []))
                break
            self.waiting.popleft()
            seq.block_table = hit + kv.allocate(need)
            seq.num_cached = reused
            seq.copy_src = src
            # keyed now, computed in this very step: a later sequence of the same step already shares them
            kv.register(seq.block_table[len(hit) :], keys[len(hit) :])
            budget -= todo
            self.prefill_tokens_computed += todo
            if kv.enable_prefix_caching:
                self.prefix_cache_queries += n
                self.prefix_cache_hits += reused
            admitted.append(seq)
            self.running.append(seq)
        return admitted

    def _reserve_decode(self) -> list[Sequence]:
        """Make room for one more token in every running sequence, preempting the newest if needed."""
        i, bs = 0, self.kv.block_size
        while i < len(self.running):
            seq = self.running[i]
            if len(seq.token_ids) <= len(seq.block_table) * bs:  # the common case: room in the last block
                i += 1
                continue
            need = self.kv.blocks_needed(len(seq.token_ids), len(seq.block_table))
            while need > self.kv.num_free and self.running[-1] is not seq:
                self._preempt(self.running[-1])
            if need > self.kv.num_free:
                self._preempt(seq)  # it is the newest itself; the ones before it keep going
                continue
            seq.block_table.extend(self.kv.allocate(need))
            i += 1
        return list(self.running)

    def reserve_ahead(self, seqs: list[Sequence]) -> bool:
        """Room for one more token than ``token_ids`` holds in each sequence (a step decoded ahead), without
        preempting anyone; False (nothing allocated) when the free blocks do not suffice."""
        bs = self.kv.block_size
        short = [s for s in seqs if len(s.token_ids) + 1 > len(s.block_table) * bs]
        if len(short) > self.kv.num_free:
            return False
        for s in short:
            s.block_table.extend(self.kv.allocate(1))
        return True

    def preempt_all(self) -> None:
        """Send every running sequence back to the front of the queue, in order, freeing its KV blocks."""
        while self.running:
            self._preempt(self.running[-1])

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.block_table)
        seq.num_cached = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

"""With ``dynamic_sampling`` off, a tied group takes its room in its step's token budget (R5, issue 36).

The planner decides what a step holds by placing samples in rows of ``token_budget`` tokens. A tied group has no
samples to place (the worker sends only its size, ``GroupResult.row_tokens``), so the trainer places *shares* in
its stead: samples of that many tokens, of a group of their own, that no other sample shares a prefix with. The
planner then fills the step exactly as if the group were trained, and the shares are taken out of the rows before
the step is returned (``strip_shares``): they are never forwarded, trained or counted in the loss's normalizer,
and a step whose rows hold nothing else is empty (the caller keeps pulling).

A share is never stale (nothing of it is trained) and carries no tokens for the staleness admission (G3): the
tied group's tokens left the worker's queue accounting when it was scored.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from asyncgrpo.packing import MicroBatch
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.packing.trie import PrefixTrie

NEVER_STALE = 1 << 62  # a share's model_version: behind() is negative, so no staleness check drops it
_serial = itertools.count(1)


@dataclass
class TiedShare:
    """The ``meta`` of a share: the tied prompt it stands for (read as the trainer's ``_Meta`` is)."""

    row_index: int
    queued_at: float
    model_version: int = NEVER_STALE
    num_tokens: int = 0  # G3: nothing of a tied group is queued


def tied_shares(row_index: int, group_id: int, tokens: int, token_budget: int, queued_at: float) -> list[PackSample]:
    """The shares of one tied group of ``tokens`` forwarded tokens: one sample when it fits a row, else pieces of
    at most ``token_budget`` (a group larger than a row spans rows, as the planner places it); none for 0 tokens."""
    if tokens <= 0:
        return []
    pieces = -(-tokens // token_budget)
    sizes = [tokens // pieces + (i < tokens % pieces) for i in range(pieces)]
    out = []
    for n in sizes:
        ids = np.full(n, -next(_serial), dtype=np.int64)  # a negative id no token has: shares no prefix
        out.append(PackSample(ids, np.zeros(n, dtype=bool), np.zeros(n, dtype=np.float32), 0.0,
                              ("tied", group_id), meta=TiedShare(row_index, queued_at)))  # fmt: skip
    return out


def is_share(sample: PackSample) -> bool:
    return isinstance(sample.meta, TiedShare)


def strip_shares(micro_batches: list[MicroBatch], share_prefixes: bool = True) -> list[MicroBatch]:
    """The micro-batches without their shares (rows rebuilt from their other samples, in order); a micro-batch
    left with no sample is left out."""
    out = []
    for mb in micro_batches:
        rows = []
        for row in mb.rows:
            if not any(is_share(s) for s in row.samples):
                rows.append(row)
                continue
            trie = PrefixTrie(share_prefixes)
            for s in row.samples:
                if not is_share(s):
                    trie.insert(s)
            rows.append(trie)
        if any(len(r) for r in rows):
            out.append(MicroBatch(rows))
    return out

"""A packed row: the model input of one process for one micro-batch, plus every trained token's loss data."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from asyncgrpo.packing.sample import PackSample
from asyncgrpo.packing.trie import PrefixTrie


@dataclass
class PackedRow:
    """One row laid out as a prefix trie (see ``trie.py`` for the layout).

    Token-wise tensors have length T (forwarded tokens); entry-wise tensors have length
    M (trained tokens over all samples: a token shared by two samples that both train it
    appears twice). The model is called with ``input_ids[None]`` and ``position_ids[None]``;
    trained token m is predicted by the hidden state at row index ``pred_index[m]``.

    Attributes:
        input_ids: [T] token ids in depth-first trie order.
        position_ids: [T] depth in the trie = position in the token's own sample.
        parent: [T] row index of the previous token on the path, -1 at roots.
        subtree_end: [T] key k is visible to query q iff ``k <= q < subtree_end[k]``.
        seg_start, seg_end: [S] row range of each segment (a maximal unbranched chain).
        seg_parent: [S] parent segment, -1 for roots; a segment's path is its ancestors' tokens + its own.
        pred_index: [M] row index of the token before each trained token in its own sample.
        target_ids: [M] the trained token.
        advantages: [M] float32, the sample's advantage.
        old_logprobs: [M] float32, the sampler's log-prob of the trained token.
        entry_sample: [M] index into ``samples``.
        entry_position: [M] position of the trained token in its sample.
        sampler_topn_ids: [M, K] or None; -1 pads rows of samples without (or with fewer) ids.
        sampler_topn_logprobs: [M, K] or None; -inf where padded.
        candidates: [C, 2] (entry, vocab id) pairs of the candidate sets, or None.
        samples: the packed samples, in insertion order.
        num_flat_tokens: tokens flat packing would forward (sum of sample lengths).
        attention_cost: sum over forwarded tokens of the keys each attends to.
        num_trained_positions: distinct row positions holding a trained token (``batch/masked_token_frac``).
        path_count: [T] how many samples' paths hold each row token: the weight an unpacked batch of the same
            samples gives it (the MoE router loss counts tokens this way).
        routed_experts: [T, layers, top_k] int16 sampler expert ids per row token (-1: none), or None when no
            sample carries routing; a token shared by several samples takes the first sample's routing.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    parent: torch.Tensor
    subtree_end: torch.Tensor
    seg_start: torch.Tensor
    seg_end: torch.Tensor
    seg_parent: torch.Tensor
    pred_index: torch.Tensor
    target_ids: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor
    entry_sample: torch.Tensor
    entry_position: torch.Tensor
    sampler_topn_ids: torch.Tensor | None
    sampler_topn_logprobs: torch.Tensor | None
    candidates: torch.Tensor | None
    samples: list[PackSample]
    num_flat_tokens: int
    attention_cost: int
    num_trained_positions: int
    path_count: torch.Tensor | None = None
    routed_experts: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Forwarded tokens T."""
        return int(self.input_ids.numel())

    @property
    def num_trained(self) -> int:
        """Trained-token entries M."""
        return int(self.target_ids.numel())

    @property
    def packing_ratio(self) -> float:
        """Flat tokens per forwarded token (1.0 without sharing)."""
        return self.num_flat_tokens / max(1, self.num_tokens)

    def to(self, device: torch.device | str) -> PackedRow:
        """A copy with every tensor on ``device`` (non-blocking where the source is pinned)."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=True)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def pack_trie(trie: PrefixTrie) -> PackedRow:
    """Build the :class:`PackedRow` of a filled trie."""
    lay = trie.layout()
    total = len(lay.input_ids)
    # segments: a token starts one unless it is the only child of the token right before it
    children = np.bincount(lay.parent[lay.parent >= 0], minlength=total)
    starts = np.ones(total, dtype=bool)
    if total:
        has_par = lay.parent >= 0
        cont = has_par & (lay.parent == np.arange(total) - 1)
        cont[has_par] &= children[lay.parent[has_par]] == 1
        starts = ~cont
    seg_start = np.flatnonzero(starts)
    seg_end = np.append(seg_start[1:], total)
    seg_of = np.cumsum(starts) - 1
    first_parent = lay.parent[seg_start]
    seg_parent = np.where(first_parent >= 0, seg_of[np.maximum(first_parent, 0)], -1)

    trained_rows = [np.zeros(0, dtype=np.int64)]
    pred, target, adv, old, ent_sample, ent_pos = [], [], [], [], [], []
    topn_k = max((s.sampler_topn_ids.shape[1] for s in trie.samples if s.sampler_topn_ids is not None), default=0)
    any_topn = any(s.sampler_topn_ids is not None for s in trie.samples)
    topn_ids, topn_lp, cand_pairs = [], [], []
    n_entries = 0
    for i, (s, rows) in enumerate(zip(trie.samples, lay.sample_index)):
        t = np.flatnonzero(s.loss_mask)  # trained positions, all >= 1
        pred.append(rows[t - 1])
        trained_rows.append(rows[t])
        target.append(s.token_ids[t])
        adv.append(np.full(len(t), s.advantage, dtype=np.float32))
        old.append(s.old_logprobs[t])
        ent_sample.append(np.full(len(t), i, dtype=np.int64))
        ent_pos.append(t)
        if any_topn:
            ids = np.full((len(t), topn_k), -1, dtype=np.int64)
            lps = np.full((len(t), topn_k), -np.inf, dtype=np.float32)
            if s.sampler_topn_ids is not None:
                k = s.sampler_topn_ids.shape[1]
                ids[:, :k], lps[:, :k] = s.sampler_topn_ids[t], s.sampler_topn_logprobs[t]
            topn_ids.append(ids)
            topn_lp.append(lps)
        if s.candidate_ids is not None:
            for j, pos in enumerate(t):
                cand = s.candidate_ids[pos]
                if cand is not None and len(cand):
                    cand = np.asarray(cand, dtype=np.int64)
                    cand_pairs.append(np.stack([np.full(len(cand), n_entries + j, dtype=np.int64), cand], 1))
        n_entries += len(t)

    def cat(parts: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.concatenate(parts)).to(dtype) if parts else torch.zeros(0, dtype=dtype)

    return PackedRow(
        input_ids=torch.from_numpy(lay.input_ids),
        position_ids=torch.from_numpy(lay.position_ids),
        parent=torch.from_numpy(lay.parent),
        subtree_end=torch.from_numpy(lay.subtree_end),
        seg_start=torch.from_numpy(seg_start.astype(np.int64)),
        seg_end=torch.from_numpy(seg_end.astype(np.int64)),
        seg_parent=torch.from_numpy(seg_parent.astype(np.int64)),
        pred_index=cat(pred, torch.long),
        target_ids=cat(target, torch.long),
        advantages=cat(adv, torch.float32),
        old_logprobs=cat(old, torch.float32),
        entry_sample=cat(ent_sample, torch.long),
        entry_position=cat(ent_pos, torch.long),
        sampler_topn_ids=torch.from_numpy(np.concatenate(topn_ids)) if any_topn else None,
        sampler_topn_logprobs=torch.from_numpy(np.concatenate(topn_lp)) if any_topn else None,
        candidates=torch.from_numpy(np.concatenate(cand_pairs)) if cand_pairs else None,
        samples=list(trie.samples),
        num_flat_tokens=trie.num_flat_tokens,
        attention_cost=trie.attention_cost,
        num_trained_positions=len(np.unique(np.concatenate(trained_rows))),
        path_count=torch.from_numpy(np.bincount(np.concatenate(lay.sample_index), minlength=total).astype(np.int64))
        if lay.sample_index
        else torch.zeros(total, dtype=torch.long),
        routed_experts=_row_routing(trie.samples, lay.sample_index, total),
    )


def _row_routing(samples: list[PackSample], sample_index: list[np.ndarray], total: int) -> torch.Tensor | None:
    """[T, layers, top_k] routing of the row's tokens: each sample's rows written last-to-first, so a shared
    prefix keeps the first sample's (one routing per forwarded token); -1 where no sample routed the token."""
    given = [(s.routed_experts, rows) for s, rows in zip(samples, sample_index) if s.routed_experts is not None]
    if not given:
        return None
    shape = given[0][0].shape[1:]
    out = np.full((total, *shape), -1, dtype=np.int16)
    for routed, rows in reversed(given):
        if routed.shape[1:] != shape:
            raise ValueError(f"samples of one row carry routing of different shapes: {routed.shape[1:]} vs {shape}")
        has = routed[:, 0, 0] >= 0
        out[rows[has]] = routed[has]
    return torch.from_numpy(out)


def pack_samples(samples: list[PackSample], share_prefixes: bool = True) -> PackedRow:
    """Pack ``samples`` into one row (no budget check; the planner enforces ``token_budget``)."""
    trie = PrefixTrie(share_prefixes=share_prefixes)
    for s in samples:
        trie.insert(s)
    return pack_trie(trie)

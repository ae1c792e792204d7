"""The inputs of bench/tree_packing.py: GRPO-shaped samples, their packed rows (tree or flat) and padded HF batches."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from asyncgrpo.packing.planner import TokenBudgetBatcher

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests/helpers
from tests.helpers.synthetic import grpo_samples

H200_BF16_PEAK = 989e12  # dense bf16 tensor-core FLOP/s of an H100/H200 SXM (no sparsity)


TOP_N = 8  # the sampler's top-N log-probs per position, as the worker asks for them


def make_samples(shape: tuple, vocab: int, seed: int) -> list:
    groups, size, prompt, comp = shape
    samples = grpo_samples(groups, size, prompt, comp, vocab_size=vocab, seed=seed)
    rng = np.random.default_rng(seed + 1)
    for s in samples:  # the sampler's top-N per position, as score centering reads it
        s.sampler_topn_ids = rng.integers(0, vocab, size=(len(s), TOP_N))
        s.sampler_topn_logprobs = np.full((len(s), TOP_N), -3.0, dtype=np.float32)
    return samples


def plan_rows(samples: list, budget: int, share: bool, keep_groups: bool = True) -> list:
    """Rows as the trainer plans them (groups kept in one row when they fit and ``keep_groups``)."""
    batcher = TokenBudgetBatcher(budget, share_prefixes=share, keep_groups=keep_groups and share)  # flat: as before
    mbs = [mb for mb in (batcher.add(s) for s in samples) if mb is not None]
    while (last := batcher.flush()) is not None:
        mbs.append(last)
    return [row for mb in mbs for row in mb.pack()]


def padded_batches(samples: list, budget: int, device: str) -> list[dict]:
    """Greedy batches in queue order with B x max_len <= budget, right-padded."""
    batches, cur = [], []
    for s in samples:
        if cur and (len(cur) + 1) * max(len(x) for x in cur + [s]) > budget:
            batches.append(cur)
            cur = []
        cur.append(s)
    batches.append(cur)
    out = []
    for b in batches:
        width = max(len(s) for s in b)
        ids = torch.zeros(len(b), width, dtype=torch.long)
        mask = torch.zeros(len(b), width, dtype=torch.long)
        rows, pos, tgt, adv, extra, old, extra_lp = [], [], [], [], [], [], []
        for i, s in enumerate(b):
            ids[i, : len(s)] = torch.from_numpy(s.token_ids)
            mask[i, : len(s)] = 1
            t = np.flatnonzero(s.loss_mask)
            rows.append(np.full(len(t), i))
            pos.append(t - 1)
            tgt.append(s.token_ids[t])
            adv.append(np.full(len(t), s.advantage, dtype=np.float32))
            extra.append(s.sampler_topn_ids[t])
            extra_lp.append(s.sampler_topn_logprobs[t])
            old.append(np.asarray(s.old_logprobs, dtype=np.float32)[t])

        def cat(parts, dtype=torch.long):
            return torch.from_numpy(np.concatenate(parts)).to(device=device, dtype=dtype)

        out.append(
            {
                "ids": ids.to(device),
                "mask": mask.to(device),
                "rows": cat(rows),
                "pos": cat(pos),
                "targets": cat(tgt),
                "adv": cat(adv, torch.float32),
                "loss_row": SimpleNamespace(
                    target_ids=cat(tgt),
                    advantages=cat(adv, torch.float32),
                    old_logprobs=cat(old, torch.float32),
                    sampler_topn_ids=cat(extra),
                    sampler_topn_logprobs=cat(extra_lp, torch.float32),
                    candidates=None,
                    entry_sample=None,
                ),
                "tokens": int(mask.sum()),
                "width": width,
            }
        )
    return out

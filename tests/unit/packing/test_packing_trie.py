"""Prefix-trie layout (SPEC P1): checked against docs/design.md's packing example and brute-force prefix counts."""

from __future__ import annotations

import numpy as np
import pytest

from asyncgrpo.packing.row import pack_samples
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.packing.trie import PrefixTrie
from tests.helpers.synthetic import random_tree_samples


def _sample(ids, mask, group=0, adv=0.0):
    return PackSample(ids, mask, [-0.5 * m for m in mask], adv, group)


def test_document_two_rollout_example():
    # r0: p1 p2 p3 a1 a2, r1: p1 p2 p3 b1 b2 (p=1,2,3 a=10,11 b=20,21); expected layout from docs/design.md.
    r0 = _sample([1, 2, 3, 10, 11], [0, 0, 0, 1, 1])
    r1 = _sample([1, 2, 3, 20, 21], [0, 0, 0, 1, 1])
    row = pack_samples([r0, r1])
    assert row.input_ids.tolist() == [1, 2, 3, 10, 11, 3, 20, 21]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert list(zip(row.seg_start.tolist(), row.seg_end.tolist())) == [(0, 2), (2, 5), (5, 8)]
    assert row.seg_parent.tolist() == [-1, 0, 0]
    assert row.pred_index.tolist() == [2, 3, 5, 6]  # a1 a2 at 2 3, b1 b2 at 5 6
    assert row.target_ids.tolist() == [10, 11, 20, 21]
    assert row.num_flat_tokens == 10 and row.num_tokens == 8
    # S2's path is rows 0 1 5 6 7: visible keys of the last token
    end = row.subtree_end.numpy()
    assert [k for k in range(8) if k <= 7 < end[k]] == [0, 1, 5, 6, 7]


def _brute_force_counts(samples):
    """Forwarded tokens and attention cost from distinct prefixes, plus one copy per extra trained branch."""
    prefixes, trained_next = set(), {}
    for s in samples:
        ids, mask = s.token_ids.tolist(), s.loss_mask.tolist()
        for i in range(len(ids)):
            prefixes.add(tuple(ids[: i + 1]))
            if i + 1 < len(ids) and mask[i + 1]:
                trained_next.setdefault(tuple(ids[: i + 1]), set()).add(ids[i + 1])
    copies = {p: max(0, len(x) - 1) for p, x in trained_next.items()}
    tokens = len(prefixes) + sum(copies.values())
    cost = sum(len(p) for p in prefixes) + sum(c * len(p) for p, c in copies.items())
    return tokens, cost


@pytest.mark.parametrize("seed", range(12))
def test_random_tries_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    samples = random_tree_samples(rng, vocab_size=int(rng.integers(8, 64)), num_groups=int(rng.integers(1, 5)))
    trie = PrefixTrie()
    for s in samples:
        predicted = trie.cost_of(s)
        assert trie.insert(s) == predicted  # dry run agrees with the real insertion
    row = pack_samples(samples)
    tokens, cost = _brute_force_counts(samples)
    assert row.num_tokens == tokens == trie.num_tokens
    assert row.attention_cost == cost == int((row.position_ids + 1).sum())
    ids, pos, end = row.input_ids.numpy(), row.position_ids.numpy(), row.subtree_end.numpy()
    keys = np.arange(row.num_tokens)
    lay = trie.layout()
    for s, rows in zip(samples, lay.sample_index):
        assert (ids[rows] == s.token_ids).all()
        assert (pos[rows] == np.arange(len(s))).all()
        for t in range(len(s)):  # a token sees exactly its own path, itself included
            visible = keys[(keys <= rows[t]) & (rows[t] < end)]
            assert visible.tolist() == sorted(rows[: t + 1].tolist())
    # one position predicts one trained token
    pred, tgt = row.pred_index.numpy(), row.target_ids.numpy()
    for p in np.unique(pred):
        assert len(set(tgt[pred == p].tolist())) == 1
    # segments: contiguous, parent segment ends right before the path continues
    starts, ends, parents = row.seg_start.numpy(), row.seg_end.numpy(), row.seg_parent.numpy()
    assert starts[0] == 0 and ends[-1] == row.num_tokens and (starts[1:] == ends[:-1]).all()
    par = row.parent.numpy()
    for s_idx, p_idx in enumerate(parents):
        assert par[starts[s_idx]] == (ends[p_idx] - 1 if p_idx >= 0 else -1)


def test_entries_carry_sample_data():
    a = PackSample(
        [5, 6, 7, 8],
        [0, 0, 1, 1],
        [0.0, 0.0, -1.0, -2.0],
        0.5,
        "g",
        sampler_topn_ids=[[0, 0], [0, 0], [7, 1], [8, 2]],
        sampler_topn_logprobs=[[0, 0], [0, 0], [-1.0, -3.0], [-2.0, -4.0]],
        candidate_ids=[None, None, [7, 1, 2], [8]],
    )
    b = PackSample([5, 6, 9], [0, 0, 1], [0.0, 0.0, -0.25], -0.5, "g")
    row = pack_samples([a, b])
    assert row.target_ids.tolist() == [7, 8, 9]
    assert row.advantages.tolist() == [0.5, 0.5, -0.5]
    assert row.old_logprobs.tolist() == [-1.0, -2.0, -0.25]
    assert row.entry_sample.tolist() == [0, 0, 1] and row.entry_position.tolist() == [2, 3, 2]
    assert row.sampler_topn_ids.tolist() == [[7, 1], [8, 2], [-1, -1]]
    assert row.sampler_topn_logprobs[2].tolist() == [float("-inf")] * 2
    assert row.candidates.tolist() == [[0, 7], [0, 1], [0, 2], [1, 8]]
    # 7 and 9 both follow 5 6 and are trained: token 6 is forwarded twice
    assert row.input_ids.tolist() == [5, 6, 7, 8, 6, 9]
    assert row.num_trained_positions == 3


def test_flat_packing_without_sharing():
    rng = np.random.default_rng(0)
    samples = random_tree_samples(rng)
    row = pack_samples(samples, share_prefixes=False)
    assert row.num_tokens == sum(len(s) for s in samples) == row.num_flat_tokens
    assert len(row.seg_start) == len(samples) and (row.seg_parent == -1).all()
    assert row.input_ids.tolist() == [t for s in samples for t in s.token_ids.tolist()]
    assert row.position_ids.tolist() == [p for s in samples for p in range(len(s))]


def test_sample_validation_messages():
    with pytest.raises(ValueError, match="loss_mask\\[0\\]"):
        PackSample([1, 2], [1, 1], [0.0, 0.0], 0.0, 0)
    with pytest.raises(ValueError, match="differ in length"):
        PackSample([1, 2], [0, 1], [0.0], 0.0, 0)
    with pytest.raises(ValueError, match="empty"):
        PackSample([], [], [], 0.0, 0)


def test_from_training_sequence_pads_ragged_top_n():
    from asyncgrpo.types import TrainingSequence

    seq = TrainingSequence(
        input_ids=[4, 5, 6, 7],
        loss_mask=[0, 0, 1, 1],
        sampler_logprobs=[0.0, 0.0, -0.5, -1.5],
        advantage=1.25,
        model_version=3,
        group_id=9,
        row_index=0,
        sampler_top_ids=[[], [], [6, 2, 3], [7]],
        sampler_top_logprobs=[[], [], [-0.5, -1.0, -2.0], [-1.5]],
        candidate_sets=[[], [], [6, 2], []],
    )
    seq.validate()
    row = pack_samples([PackSample.from_sequence(seq)])
    assert row.samples[0].meta is seq and row.samples[0].group_id == 9
    assert row.target_ids.tolist() == [6, 7] and row.advantages.tolist() == [1.25, 1.25]
    assert row.sampler_topn_ids.tolist() == [[6, 2, 3], [7, -1, -1]]
    assert row.sampler_topn_logprobs.tolist() == [[-0.5, -1.0, -2.0], [-1.5, float("-inf"), float("-inf")]]
    assert row.candidates.tolist() == [[0, 6], [0, 2]]  # the empty set of token 7 means the full vocabulary

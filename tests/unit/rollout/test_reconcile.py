"""A5 reconciliation: turns -> training sequences, checked on hand-made turns."""

import pytest

from asyncgrpo.metrics import MetricsWindow, is_documented_metric
from asyncgrpo.rollout.reconcile import ReconcileStats, rollout_to_sequences
from asyncgrpo.types import Rollout, TurnRecord


def _seqs(turns, n_top=None, stats=None):
    r = Rollout(completion=[], completion_ids=[], turns=turns)
    return rollout_to_sequences(r, group_id=3, row_index=7, model_version=2, num_sampler_logprobs=n_top, stats=stats)


def test_single_turn_is_prompt_plus_completion():
    t = TurnRecord(
        prompt_ids=[1, 2, 3],
        output_ids=[4, 5],
        output_log_probs=[-0.1, -0.2],
        output_sampler_logprobs=[{4: -0.1, 9: -2.0, 8: -3.0}, {7: -0.5, 5: -0.2}],
    )
    (s,) = _seqs([t], n_top=2)
    assert s.input_ids == [1, 2, 3, 4, 5]
    assert s.loss_mask == [0, 0, 0, 1, 1]
    assert s.sampler_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2]
    assert s.sampler_top_ids == [[], [], [], [4, 9], [5, 7]]  # best first, cut to 2
    assert s.sampler_top_logprobs[3] == [-0.1, -2.0]
    assert (s.group_id, s.row_index, s.model_version) == (3, 7, 2)
    s.validate()


def test_extension_and_fork():
    t1 = TurnRecord(prompt_ids=[1, 2], output_ids=[3], output_log_probs=[-0.3])
    t2 = TurnRecord(prompt_ids=[1, 2, 3, 10, 11], output_ids=[4], output_log_probs=[-0.4])  # extends
    t3 = TurnRecord(prompt_ids=[1, 2, 99, 10, 11, 4, 12], output_ids=[5, 6], output_log_probs=[-0.5, -0.6])  # fork
    stats = ReconcileStats()
    a, b = _seqs([t1, t2, t3], stats=stats)
    assert a.input_ids == [1, 2, 3, 10, 11, 4] and a.loss_mask == [0, 0, 1, 0, 0, 1]
    assert a.sampler_logprobs == [0.0, 0.0, -0.3, 0.0, 0.0, -0.4]
    assert b.input_ids == [1, 2, 99, 10, 11, 4, 12, 5, 6] and b.loss_mask == [0] * 7 + [1, 1]
    # every sampled token trained exactly once
    assert sum(a.loss_mask) + sum(b.loss_mask) == 4
    assert stats.transitions == 2 and stats.forks == 1
    assert stats.drift_tokens == [0, 4]  # held 6 tokens, common prefix 2
    assert a.sampler_top_ids is None and b.candidate_sets is None


def test_output_mask_and_candidate_sets_travel():
    t = TurnRecord(
        prompt_ids=[1],
        output_ids=[2, 3],
        output_log_probs=[-0.1, -0.2],
        output_mask=[1, 0],
        output_sampling_mask=[[2, 5], [3]],
    )
    (s,) = _seqs([t])
    assert s.loss_mask == [0, 1, 0]
    assert s.candidate_sets == [[], [2, 5], [3]]


def test_rollout_without_trained_tokens_yields_nothing():
    t = TurnRecord(prompt_ids=[1], output_ids=[2], output_log_probs=[-0.1], output_mask=[0])
    assert _seqs([t]) == []


def test_reconcile_metrics_over_a_window():
    # Rollout A: the fork of test_extension_and_fork (2 transitions, 1 fork re-rendering 4 tokens, 2 samples).
    t1 = TurnRecord(prompt_ids=[1, 2], output_ids=[3], output_log_probs=[-0.3])
    t2 = TurnRecord(prompt_ids=[1, 2, 3, 10, 11], output_ids=[4], output_log_probs=[-0.4])
    t3 = TurnRecord(prompt_ids=[1, 2, 99, 10, 11, 4, 12], output_ids=[5, 6], output_log_probs=[-0.5, -0.6])
    # Rollout B: one turn, one sample. Rollout C: one turn whose only token is masked out, no sample.
    t4 = TurnRecord(prompt_ids=[1], output_ids=[2], output_log_probs=[-0.1])
    t5 = TurnRecord(prompt_ids=[1], output_ids=[2], output_log_probs=[-0.1], output_mask=[0])
    stats = ReconcileStats()
    seqs = [_seqs(turns, stats=stats) for turns in ([t1, t2, t3], [t4], [t5])]
    window = MetricsWindow()
    window.extend(stats.metric_events(sum(len(s) for s in seqs), num_rollouts=3))
    # A second group of single-turn rollouts adds rollouts but no transitions.
    window.extend(ReconcileStats().metric_events(num_sequences=2, num_rollouts=2))
    m = window.flush()
    assert m["rollout/samples_per_rollout"] == pytest.approx((3 + 2) / 5)
    assert m["rollout/fork_frac"] == pytest.approx(1 / 2)
    assert m["rollout/drift_tokens_mean"] == pytest.approx((0 + 4) / 2)
    assert m["rollout/drift_tokens_max"] == 4
    assert all(is_documented_metric(name) for name in m)


def test_single_turn_groups_emit_no_fork_metrics():
    events = ReconcileStats().metric_events(num_sequences=4, num_rollouts=4)
    assert [name for name, _, _ in events] == ["rollout/samples_per_rollout"]
    with pytest.raises(ValueError, match="num_rollouts"):
        ReconcileStats().metric_events(num_sequences=0, num_rollouts=0)


def test_array_top_n_of_a_multi_turn_rollout_matches_the_dict_path():
    """Turns whose top-N came as arrays (the client's ``TopLogprobs``) give the [L, K] arrays the per-position dicts
    give as ragged lists, padded with -1 / -inf (prompt and tool-result positions included); candidate sets appear
    only for the turn that has them, and a top-N block that does not match its turn's tokens is left to validate()."""
    import numpy as np

    from asyncgrpo.client.top_logprobs import completion_top_arrays

    def arrays(rows):
        return completion_top_arrays([{f"token_id:{i}": v for i, v in row.items()} for row in rows])

    rows1 = [{4: -0.1, 9: -2.0, 8: -3.0}, {7: -0.5, 5: -0.2}]
    rows2 = [{6: -0.3, 2: -0.3, 1: -9999.0}]
    t1 = TurnRecord(
        prompt_ids=[1, 2, 3], output_ids=[4, 5], output_log_probs=[-0.1, -0.2], output_sampler_logprobs=rows1
    )
    t2 = TurnRecord(prompt_ids=[1, 2, 3, 4, 5, 10], output_ids=[6], output_log_probs=[-0.3],
                    output_sampler_logprobs=rows2, output_sampling_mask=[[6, 2]])  # fmt: skip
    (ragged,) = _seqs([t1, t2], n_top=2)
    t1.output_sampler_logprobs, t2.output_sampler_logprobs = arrays(rows1), arrays(rows2)
    (packed,) = _seqs([t1, t2], n_top=2)
    assert packed.input_ids == ragged.input_ids == [1, 2, 3, 4, 5, 10, 6]
    assert ragged.sampler_top_ids == [[], [], [], [4, 9], [5, 7], [], [6, 2]]  # ties in the answer's order
    padded_ids = [row + [-1] * (2 - len(row)) for row in ragged.sampler_top_ids]
    padded_lps = [row + [-np.inf] * (2 - len(row)) for row in ragged.sampler_top_logprobs]
    assert packed.sampler_top_ids.dtype == np.int32 and packed.sampler_top_logprobs.dtype == np.float32
    assert packed.sampler_top_ids.tolist() == padded_ids
    assert packed.sampler_top_logprobs.tolist() == np.array(padded_lps, dtype=np.float32).tolist()
    assert packed.candidate_sets == ragged.candidate_sets == [[], [], [], [], [], [], [6, 2]]
    packed.advantage = 1.0
    packed.validate()
    t2.output_sampler_logprobs = arrays(rows2 + rows2)  # two top-N rows for one token
    (bad,) = _seqs([t1, t2], n_top=2)
    bad.advantage = 1.0
    with pytest.raises(ValueError, match="sampler_top_ids"):
        bad.validate()

"""Invariants of the cross-process records (T9)."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from asyncgrpo.types import Rollout, RolloutGroup, RoutedTurn, TrainingSequence, TurnRecord


def _sequence(**overrides) -> TrainingSequence:
    base = {
        "input_ids": [5, 6, 7, 8],
        "loss_mask": [0, 0, 1, 1],
        "sampler_logprobs": [0.0, 0.0, -0.5, -1.25],
        "advantage": 0.7,
        "model_version": 3,
        "group_id": 2,
        "row_index": 11,
        "sampler_top_ids": [[], [], [7, 1], [8, 2]],
        "sampler_top_logprobs": [[], [], [-0.5, -1.0], [-1.25, -0.4]],
        "candidate_sets": [[], [], [7, 1, 3], []],
    }
    base.update(overrides)
    return TrainingSequence(**base)


def test_document_field_names_and_defaults():
    # Field lists transcribed from the reference's signatures (T9 in docs/spec.md).
    assert [f.name for f in dataclasses.fields(TurnRecord)] == [
        "prompt_ids",
        "output_ids",
        "output_log_probs",
        "output_mask",
        "output_sampling_mask",
        "output_sampler_logprobs",
    ]
    assert [f.name for f in dataclasses.fields(Rollout)] == [
        "completion",
        "completion_ids",
        "turns",
        "tool_call_count",
        "tool_failure_count",
        "reward",
        "rollout_id",
    ]
    assert [f.name for f in dataclasses.fields(RolloutGroup)] == [
        "prompts",
        "reward_kwargs",
        "completions",
        "completions_ids",
        "completions_sequences",
        "tool_call_counts",
        "tool_failure_counts",
        "model_version",
        "group_id",
        "row_index",
        "env_rewards",
        "rollout_rewards",
        "queued_at",
        "rewards",
    ]
    turn = TurnRecord(prompt_ids=[1], output_ids=[])
    assert turn.output_log_probs == [] and turn.output_mask is None
    r1 = Rollout(completion=[], completion_ids=[], turns=[])
    r2 = Rollout(completion=[], completion_ids=[], turns=[])
    assert r1.reward is None and r1.tool_call_count == 0
    assert len(r1.rollout_id) == 16 and int(r1.rollout_id, 16) >= 0 and r1.rollout_id != r2.rollout_id


def test_turn_record_valid_and_broken():
    ok = TurnRecord(
        prompt_ids=[1, 2],
        output_ids=[3, 4],
        output_log_probs=[-0.1, -2.0],
        output_mask=[1, 0],
        output_sampling_mask=[[3, 9], []],
        output_sampler_logprobs=[{3: -0.1, 9: -2.5}, {4: -2.0}],
    )
    ok.validate()
    with pytest.raises(ValueError, match="output_log_probs has 1 entries but output_ids has 2"):
        dataclasses.replace(ok, output_log_probs=[-0.1]).validate()
    with pytest.raises(ValueError, match="does not contain the sampled token 3"):
        dataclasses.replace(ok, output_sampling_mask=[[9], []]).validate()
    with pytest.raises(ValueError, match="0 or 1"):
        dataclasses.replace(ok, output_mask=[2, 0]).validate()
    # Nothing trained: log-probs may be omitted.
    TurnRecord(prompt_ids=[1], output_ids=[3], output_mask=[0]).validate()


def test_rollout_reports_the_broken_turn():
    bad_turn = TurnRecord(prompt_ids=[1], output_ids=[3, 4], output_log_probs=[-0.1])
    with pytest.raises(ValueError, match=r"turns\[0\]"):
        Rollout(completion=[], completion_ids=[3, 4], turns=[bad_turn]).validate()
    with pytest.raises(ValueError, match="exceeds tool_call_count"):
        Rollout(completion=[], completion_ids=[], turns=[], tool_call_count=1, tool_failure_count=2).validate()


def test_training_sequence_invariants():
    seq = _sequence()
    seq.validate()
    assert seq.num_tokens == 4 and seq.num_trained_tokens == 2
    with pytest.raises(ValueError, match="loss_mask has 3 entries"):
        _sequence(loss_mask=[0, 1, 1]).validate()
    with pytest.raises(ValueError, match=r"loss_mask\[0\] must be 0"):
        _sequence(loss_mask=[1, 0, 1, 1]).validate()
    with pytest.raises(ValueError, match=r"sampler_logprobs\[3\]"):
        _sequence(sampler_logprobs=[0.0, 0.0, -0.5, 0.3]).validate()
    with pytest.raises(ValueError, match="differ in length"):
        _sequence(sampler_top_logprobs=[[], [], [-0.5], [-1.25, -0.4]]).validate()
    with pytest.raises(ValueError, match="given together"):
        _sequence(sampler_top_logprobs=None).validate()
    with pytest.raises(ValueError, match=r"candidate_sets\[2\] does not contain the token 7"):
        _sequence(candidate_sets=[[], [], [1, 3], []]).validate()
    with pytest.raises(ValueError, match="advantage must be finite"):
        _sequence(advantage=float("nan")).validate()


def test_records_pickle_round_trip():
    seq = _sequence()
    group = RolloutGroup(
        prompts=[[{"role": "user", "content": "hi"}]] * 2,
        reward_kwargs={"solution": ["1", "1"]},
        completions=[[{"role": "assistant", "content": "a"}]] * 2,
        completions_ids=[[7, 8], [7, 9]],
        completions_sequences=[[seq], [seq]],
        tool_call_counts=[0, 0],
        tool_failure_counts=[0, 0],
        model_version=3,
        group_id=2,
        row_index=11,
        env_rewards=[None, None],
        rollout_rewards=[None, 1.0],
        rewards=np.array([0.0, 1.0]),
    )
    group.validate()
    back = pickle.loads(pickle.dumps(group))
    assert back.completions_sequences[1][0] == seq and np.array_equal(back.rewards, group.rewards)
    with pytest.raises(ValueError, match=r"reward_kwargs\['solution'\] has 1 entries"):
        dataclasses.replace(group, reward_kwargs={"solution": ["1"]}).validate()


def test_routed_turn_checks_its_rows():
    routed = np.zeros((5, 2, 2), dtype=np.uint8)  # prompt 3 + output 3 - 1 - start 0
    ok = RoutedTurn(prompt_ids=[1, 2, 3], output_ids=[4, 5, 6], output_log_probs=[-0.1] * 3, routed_experts=routed)
    ok.validate()
    assert isinstance(ok, TurnRecord)  # every hook still sees a TurnRecord
    RoutedTurn([1, 2, 3], [4, 5, 6], [-0.1] * 3, routed_experts=routed[2:], routed_experts_start=2).validate()
    with pytest.raises(ValueError, match=r"must be \[5, layers, top_k\]"):
        RoutedTurn([1, 2, 3], [4, 5, 6], [-0.1] * 3, routed_experts=routed[1:]).validate()
    with pytest.raises(ValueError, match="routed_experts_start=4 is outside"):
        RoutedTurn([1, 2, 3], [4], [-0.1], routed_experts_start=4).validate()
    bad = _sequence(routed_experts=np.zeros((4, 2, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match="int16"):
        bad.validate()
    _sequence(routed_experts=np.full((4, 2, 2), -1, dtype=np.int16)).validate()

"""``score_group`` is a pure function of a group: its totals, advantages, drop and metric events against values
worked out by hand below (R3-R5, M1)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncgrpo.rollout.advantages import group_advantages
from asyncgrpo.rollout.agents.stats import ToolLoopStats
from asyncgrpo.rollout.records import SampledTurn, ToolLoopRollout, finish_reason, tool_loop_stats
from asyncgrpo.rollout.scoring import GroupOrigin, score_group, trainable_samples
from asyncgrpo.types import Rollout, RolloutGroup, TurnRecord


class Env:
    """Stands for an environment class (its name keys ``rewards/Env/*``)."""


PROMPT = [{"role": "user", "content": "q"}]
ORIGIN = GroupOrigin(group_id=7, row_index=3, flat_index=13, epoch=1, model_version=5)


def _rollout(output_ids: list[int], finish: str | None, stats: ToolLoopStats | None = None, **kw) -> Rollout:
    """A one-turn rollout; ``finish`` None: a turn of custom code (a plain ``TurnRecord``, no finish reason)."""
    lps = [-0.5] * len(output_ids)
    if finish is None:
        turn = TurnRecord([1, 2], output_ids, lps)
    else:
        turn = SampledTurn([1, 2], output_ids, lps, finish_reason=finish)
    rollout = Rollout([{"role": "assistant", "content": "x"}], output_ids, [turn], **kw)
    return rollout if stats is None else ToolLoopRollout.of(rollout, stats)


def _group() -> tuple[list[Rollout], list, np.ndarray]:
    stats = ToolLoopStats(calls=[("add", True, 0.2), ("add", False, 0.4)], parallel=[2], exhausted=True)
    rollouts = [
        _rollout([5, 6, 7], "stop", stats, tool_call_count=2, tool_failure_count=1),
        _rollout([5, 6], "length"),
        _rollout([5, 6, 7], "stop"),  # the same tokens as the first: a duplicate
        _rollout([8], None, reward=1.0),  # a turn of custom code: counted as stopped
    ]
    env_rewards = [None, None, (Env, 2.0), None]
    nan = math.nan
    per_func = np.array([[1.0, 0.5], [0.0, 0.5], [nan, nan], [1.0, nan]])  # columns: acc, fmt
    return rollouts, env_rewards, per_func


def _score(rollouts, env_rewards, per_func, compute_advantages=None):
    seen: list[RolloutGroup] = []

    def advantages(group: RolloutGroup) -> np.ndarray:
        seen.append(group)
        return (compute_advantages or (lambda g: group_advantages(g.rewards)))(group)

    scored = score_group(
        rollouts, [PROMPT] * len(rollouts), env_rewards, per_func, reward_names=["acc", "fmt"],
        reward_kwargs={"answer": ["4"] * len(rollouts)}, origin=ORIGIN, num_sampler_logprobs=None, has_tools=True,
        compute_advantages=advantages, queued_at=12.5,
    )  # fmt: skip
    return scored, seen


def test_a_group_is_scored_as_worked_out_by_hand():
    rollouts, env_rewards, per_func = _group()
    scored, seen = _score(rollouts, env_rewards, per_func)
    # totals: 1 + 0.5 | 0 + 0.5 | env 2 | 1 + Rollout.reward 1
    assert scored.group.rewards.tolist() == [1.5, 0.5, 2.0, 2.0]
    assert seen == [scored.group] and scored.group.queued_at == 12.5 and scored.group.row_index == 3
    # mean 1.5; deviations 0, -1, .5, .5; variance (0 + 1 + .25 + .25) / 3 = 0.5
    s = math.sqrt(0.5)
    assert scored.advantages == pytest.approx([0.0, -1 / s, 0.5 / s, 0.5 / s])
    assert not scored.dropped
    events = {name: (value, weight) for name, value, weight in scored.events}
    assert len(events) == len(scored.events)  # one event per name
    third = 1 / 3
    expected = {
        "frac_reward_zero_std": (0.0, 1.0),
        "reward": (1.5, 4.0),
        "reward_kept": (1.5, 4.0),
        "reward_group_std": (s, 4.0),
        "rewards/acc/mean": (2 * third, 3.0),  # 1, 0, 1 scored
        "rewards/acc/group_std": (math.sqrt(third), 4.0),  # ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3
        "rewards/fmt/mean": (0.5, 2.0),
        "rewards/fmt/group_std": (0.0, 4.0),
        "rewards/Env/mean": (2.0, 1.0),  # one scored rollout: no group_std
        "completions/mean_length": (9 / 4, 4.0),
        "completions/max_length": (3.0, 1.0),
        "completions/min_length": (1.0, 1.0),
        "completions/mean_terminated_length": (7 / 3, 3.0),  # 3, 3, 1 (the "length" one left out)
        "completions/max_terminated_length": (3.0, 1.0),
        "completions/min_terminated_length": (1.0, 1.0),
        "completions/clipped_ratio": (0.25, 4.0),
        "completions/duplicate_frac": (0.25, 4.0),
        "rollout/turns_mean": (1.0, 4.0),
        "rollout/turns_max": (1.0, 1.0),
        "rollout/samples_per_rollout": (1.0, 4.0),
        "tools/call_frequency": (0.5, 4.0),
        "tools/failure_frequency": (0.5, 2.0),
        "tools/loop_exhausted_frac": (0.25, 4.0),
        "tools/unknown_name_count": (0.0, 1.0),
        "tools/parallel_calls_mean": (2.0, 1.0),
        "tools/latency_s": (0.3, 2.0),
        "tools/add/latency_s": (0.3, 2.0),
        "tools/add/call_count": (2.0, 1.0),
        "tools/add/failure_count": (1.0, 1.0),
    }
    assert set(events) == set(expected)
    for name, (value, weight) in expected.items():
        assert events[name] == (pytest.approx(value), weight), name
    kept, problems = trainable_samples(scored)
    assert problems == []
    assert [s.input_ids for s in kept] == [[1, 2, 5, 6, 7], [1, 2, 5, 6], [1, 2, 5, 6, 7], [1, 2, 8]]
    assert [s.advantage for s in kept] == pytest.approx([0.0, -1 / s, 0.5 / s, 0.5 / s])
    assert {(s.group_id, s.row_index, s.model_version) for s in kept} == {(7, 13, 5)}  # the flat index


def test_equal_rewards_drop_the_group_whatever_the_advantages_say():
    rollouts, env_rewards, _ = _group()
    per_func = np.array([[1.0, np.nan], [1.0, np.nan], [np.nan, np.nan], [0.0, np.nan]])  # totals 1, 1, 2, 1
    env_rewards = [None, None, None, None]
    per_func[2, 0] = 1.0
    scored, _ = _score(rollouts, env_rewards, per_func, compute_advantages=lambda g: np.ones(4))
    assert scored.group.rewards.tolist() == [1.0, 1.0, 1.0, 1.0] and scored.dropped
    events = {name: (value, weight) for name, value, weight in scored.events}
    assert events["frac_reward_zero_std"] == (1.0, 1.0) and events["reward_dropped"] == (1.0, 4.0)
    assert "reward_group_std" not in events and "reward_kept" not in events
    assert trainable_samples(scored) == ([], [])


def test_advantages_of_the_wrong_shape_are_refused():
    rollouts, env_rewards, per_func = _group()
    with pytest.raises(ValueError, match=r"shape \(3,\); expected \(4,\)"):
        _score(rollouts, env_rewards, per_func, compute_advantages=lambda g: np.zeros(3))


def test_a_tool_loop_rollout_is_the_same_rollout_with_its_stats():
    plain = _group()[0][1]  # finish reason "length"
    stats = ToolLoopStats(unknown_names=2)
    rollout = ToolLoopRollout.of(plain, stats)
    assert isinstance(rollout, Rollout) and rollout.tool_loop_stats is stats
    same = [
        (f, getattr(rollout, f), getattr(plain, f)) for f in ("completion", "completion_ids", "turns", "rollout_id")
    ]
    assert all(a is b for _, a, b in same)
    assert (finish_reason(rollout), finish_reason(plain), tool_loop_stats(plain)) == ("length", "length", None)

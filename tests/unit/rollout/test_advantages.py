"""Group advantages (R4), zero-std drop (R5) and the reward metrics, against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from asyncgrpo.metrics import MetricsWindow
from asyncgrpo.rollout.advantages import group_advantages, group_reward_metrics, is_zero_std_group

NAN = float("nan")


def test_advantages_with_none_rewards():
    # scored: 1, 0, 0 -> mean 1/3, sample std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    rewards = np.array([1.0, NAN, 0.0, 0.0, NAN])
    adv = group_advantages(rewards)
    s = math.sqrt(1 / 3)
    np.testing.assert_allclose(adv, [(2 / 3) / s, 0.0, (-1 / 3) / s, (-1 / 3) / s, 0.0])
    assert adv[1] == 0.0 and adv[4] == 0.0
    assert not is_zero_std_group(rewards)


def test_always_scaled_by_group_std():
    a = group_advantages(np.array([0.0, 10.0]))
    b = group_advantages(np.array([0.0, 0.1]))
    # (r - 5) / std with std = sqrt(50): +-5/sqrt(50) = +-1/sqrt(2), whatever the reward scale
    np.testing.assert_allclose(a, [-1 / math.sqrt(2), 1 / math.sqrt(2)])
    np.testing.assert_allclose(a, b)


def test_zero_std_and_unscorable_groups_dropped():
    assert is_zero_std_group(np.array([1.0, 1.0, 1.0]))
    assert is_zero_std_group(np.array([1.0, NAN, 1.0]))  # equal among the scored
    assert is_zero_std_group(np.array([0.3, NAN, NAN]))  # fewer than two scorable
    assert is_zero_std_group(np.array([NAN, NAN]))
    assert not is_zero_std_group(np.array([0.3, NAN, 0.4]))
    np.testing.assert_array_equal(group_advantages(np.array([1.0, 1.0, NAN])), [0.0, 0.0, 0.0])

    # Scored 0 and 2: mean 1, sample std (ddof 1) sqrt(2) -> -+1/sqrt(2); the unscored rollout gets 0.
    np.testing.assert_allclose(group_advantages(np.array([0.0, NAN, 2.0])), [-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)])


def test_reward_metrics_over_a_window():
    window = MetricsWindow()
    groups = [
        # kept: totals 1, 0, 2 (std 1); function "acc" scored all, "fmt" only two
        (np.array([1.0, 0.0, 2.0]), {"acc": np.array([1.0, 0.0, 1.0]), "fmt": np.array([NAN, NAN, 1.0])}, False),
        # dropped, saturated at 1
        (np.array([1.0, 1.0, 1.0]), {"acc": np.array([1.0, 1.0, 1.0]), "fmt": np.array([0.0, 0.0, 0.0])}, True),
        # dropped, nothing scored: counted in frac_reward_zero_std, not in reward_dropped
        (np.array([NAN, NAN, NAN]), {"acc": np.array([NAN, NAN, NAN])}, True),
    ]
    for rewards, per_source, dropped in groups:
        assert is_zero_std_group(rewards) == dropped
        window.extend(group_reward_metrics(rewards, per_source, dropped))
    m = window.flush()
    assert m["frac_reward_zero_std"] == pytest.approx(2 / 3)
    assert m["reward"] == pytest.approx((1 + 0 + 2 + 1 + 1 + 1) / 6)  # every scored completion
    assert m["reward_kept"] == pytest.approx(1.0)
    assert m["reward_dropped"] == pytest.approx(1.0)
    assert m["reward_group_std"] == pytest.approx(1.0)  # kept groups only
    assert m["rewards/acc/mean"] == pytest.approx(5 / 6)  # 1,0,1,1,1,1 (dropped groups included)
    assert m["rewards/fmt/mean"] == pytest.approx(1 / 4)  # 1 from group 0, three 0s from group 1
    assert m["rewards/acc/group_std"] == pytest.approx(math.sqrt(1 / 3))
    assert "rewards/fmt/group_std" not in m  # fewer than two values in the kept group

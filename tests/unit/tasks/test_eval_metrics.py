"""pass@k, mean@k and maj@k against values worked out by hand in each test."""

from __future__ import annotations

import math
from itertools import combinations

import pytest

from asyncgrpo.tasks.eval_metrics import answer_extractor, majority_answer, pass_at_k, report_ks, set_metrics
from asyncgrpo.tasks.reasoning import extract_answer, format_reward, numeric_answer_reward


def test_pass_at_k_matches_the_binomial_formula_and_the_subset_count():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # n=4, c=1, k=1: 1 - C(3,1)/C(4,1) = 1 - 3/4
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n=4, c=1, k=4: every 4-subset holds the passing sample
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    # An independent check: the fraction of k-subsets of n samples holding a passing one, counted one by one.
    samples = [True, False, True, False, False, False, False]
    for k in range(1, 8):
        subsets = list(combinations(samples, k))
        counted = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(7, 2, k) == pytest.approx(counted)
        assert pass_at_k(7, 2, k) == pytest.approx(1 - math.comb(5, k) / math.comb(7, k))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)


def test_majority_answer_takes_the_most_votes_then_the_earliest():
    assert majority_answer(["3", "4", "4", "3", "5"]) == 0  # 3 and 4 tie at two votes; "3" came first
    assert majority_answer(["3", "4", "4"]) == 1
    assert majority_answer([None, "7", None]) == 1
    assert majority_answer([None, None]) is None


def test_report_ks():
    assert report_ks(1) == [1]
    assert report_ks(4) == [1, 2, 4]
    assert report_ks(6) == [1, 2, 4, 6]


def test_set_metrics_on_a_hand_made_sample_set():
    # Two prompts, four samples each; rewards 1.0 = correct (threshold 1.0), 0.5 is a partial score.
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 0.0, 0.0]]
    answers = [["12", "7", "7", "12"], ["3", "9", "9", "9"]]
    m = set_metrics(rewards, answers, pass_threshold=1.0)
    # mean@1: (1.0 + 0.0) / 2; mean@2: ((1+0)/2 + (0+0.5)/2) / 2 = (0.5 + 0.25) / 2; mean@4: (0.5 + 0.125) / 2
    assert m["mean@1"] == pytest.approx(0.5)
    assert m["mean@2"] == pytest.approx(0.375)
    assert m["mean@4"] == pytest.approx(0.3125)
    # pass@k: prompt 0 has c=2 of n=4, prompt 1 has c=0 (0.5 is below the threshold)
    assert m["pass@1"] == pytest.approx((1 - 2 / 4) / 2)  # 1 - C(2,1)/C(4,1) = 0.5
    assert m["pass@2"] == pytest.approx((1 - 1 / 6) / 2)  # 1 - C(2,2)/C(4,2)
    assert m["pass@4"] == pytest.approx(0.5)
    # maj@1: first answers, prompt 0 right ("12" scores 1.0); maj@2: "12"/"7" tie -> "12" (first), right
    # maj@4: prompt 0 "12"/"7" tie -> "12", right; prompt 1 "9" (three votes) scores 0.5 < 1 -> wrong
    assert (m["maj@1"], m["maj@2"], m["maj@4"]) == (0.5, 0.5, 0.5)
    # maj@4 with a threshold of 0.5 counts prompt 1's majority answer as right
    assert set_metrics(rewards, answers, pass_threshold=0.5)["maj@4"] == 1.0


def test_set_metrics_without_answers_has_no_maj_and_unscored_samples_fail():
    m = set_metrics([[float("nan"), 1.0]], None, ks=[1, 2])
    assert "maj@1" not in m
    assert math.isnan(m["mean@1"])
    assert m["mean@2"] == 1.0  # the unscored sample is left out of the mean
    assert m["pass@1"] == pytest.approx(0.5)  # ... but cannot pass
    with pytest.raises(ValueError, match="same number"):
        set_metrics([[1.0], [1.0, 0.0]], None)


def test_the_answer_rewards_expose_their_extractor():
    assert answer_extractor([format_reward, numeric_answer_reward]) is extract_answer
    assert answer_extractor([format_reward]) is None
    assert extract_answer("so <answer> 42 </answer>") == "42"

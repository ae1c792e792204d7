"""The compact step line says why a reward column is missing (issue 44 item 6).

The windows are built the way the trainer builds them: each scored group's events from
``group_reward_metrics`` go through a ``MetricsWindow``, and the line is formatted from its flush.
"""

from __future__ import annotations

import numpy as np

from asyncgrpo.metrics import MetricsWindow
from asyncgrpo.report.live import compact_line
from asyncgrpo.rollout.advantages import group_reward_metrics, is_zero_std_group

STEP = {"completions/mean_length": 25.0, "perf/step_s": 20.0}  # what every step logs besides rewards


def _window(*groups: list[float]) -> dict[str, float]:
    window = MetricsWindow()
    for rewards in groups:
        r = np.asarray(rewards, dtype=np.float64)
        window.extend(group_reward_metrics(r, {}, dropped=is_zero_std_group(r)))
    return {**STEP, **window.flush()}


def test_a_step_with_trained_groups_has_no_note():
    line = compact_line(3, 8, _window([0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]))
    # reward over all 8 completions: 6/8; kept: the first group's 2/4; zero-std: 1 group of 2
    assert line == "step   3/8  reward 0.75  kept 0.5  zero-std 0.5  len 25  step s 20"


def test_a_step_without_scored_groups_says_it_trained_earlier_groups():
    line = compact_line(3, 8, _window())
    assert "reward" not in line.split("(")[0]
    assert line.endswith("(no group finished scoring during this step: it trained groups scored before)")


def test_a_step_whose_groups_were_all_dropped_says_so():
    line = compact_line(6, 8, _window([1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]))
    assert line.startswith("step   6/8  reward 0.5  zero-std 1  len 25")  # no kept column
    assert line.endswith(
        "(every group scored during this step was dropped: equal rewards within each group, no signal)"
    )


def test_a_step_whose_completions_were_all_unscored_says_so():
    line = compact_line(2, 8, _window([float("nan")] * 4))
    assert line.endswith("(no completion of the groups scored during this step could be scored)")

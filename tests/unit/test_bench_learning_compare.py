"""bench/learning.py's B6/B8 figures from two runs' summaries, against numbers worked out by hand."""

from __future__ import annotations

import pytest

from bench.learning import compare, steps_at, time_to_reach


def _run(steps_per_min: float, wait_share: float, step_s: float, wait_s: float, curve: list[tuple[float, float]]
         ) -> dict:  # fmt: skip
    points = [{"train_s": t, "step": i, "accuracy": acc} for i, (t, acc) in enumerate(curve)]
    return {"steps_per_min": steps_per_min, "rollout_wait_share": wait_share, "step_s_median": step_s,
            "rollout_wait_s_median": wait_s, "curve": points, "train_s": curve[-1][0],
            "accuracy_before": curve[0][1], "accuracy_after": curve[-1][1]}  # fmt: skip


def test_b6_b8_and_the_sync_runs_split_between_generation_and_training() -> None:
    sync = _run(30.0, 0.6, step_s=2.0, wait_s=1.2, curve=[(0, 0.1), (60, 0.3), (150, 0.5)])
    asyn = _run(54.0, 0.1, step_s=1.1, wait_s=0.1, curve=[(0, 0.1), (30, 0.2), (60, 0.45), (90, 0.55), (150, 0.6)])
    got = compare({"async": asyn, "sync": sync})
    assert got["b6_steps_per_min_ratio"] == pytest.approx(54 / 30)
    assert got["sync_generation_s_per_step"] == pytest.approx(1.2)
    assert got["sync_training_s_per_step"] == pytest.approx(0.8)
    assert got["ideal_async_ratio"] == pytest.approx(2.0 / 1.2)  # (g + t) / max(g, t)
    assert got["async_s_to_sync_final_accuracy"] == 90  # the first evaluation at >= 0.5
    assert got["b8_sooner_ratio"] == pytest.approx(150 / 90)
    assert got["async_gain_points"] == pytest.approx(50.0)
    assert got["sync_gain_points"] == pytest.approx(40.0)


def test_async_that_never_reaches_sync_has_no_b8_ratio() -> None:
    sync = _run(30.0, 0.6, 2.0, 1.2, [(0, 0.1), (150, 0.5)])
    asyn = _run(31.0, 0.5, 1.9, 1.0, [(0, 0.1), (150, 0.4)])
    got = compare({"async": asyn, "sync": sync})
    assert got["b8_sooner_ratio"] is None and got["async_s_to_sync_final_accuracy"] is None
    assert time_to_reach(asyn["curve"], 0.05) == 0  # the base model already meets a low target


def test_b6_over_the_same_stretch_of_training_clock() -> None:
    sync = _run(12.0, 0.6, 2.0, 1.2, [(0, 0.1), (50, 0.3), (100, 0.5)])  # steps 0, 1, 2 at 0, 50, 100 s
    asyn = _run(8.0, 0.7, 10.0, 8.0, [(0, 0.1), (80, 0.5), (160, 0.55), (300, 0.6)])  # steps 0..3
    assert steps_at(asyn["curve"], 100.0) == pytest.approx(1.25)  # a quarter of the way from step 1 to step 2
    got = compare({"async": asyn, "sync": sync})
    assert got["b6_equal_clock_steps_ratio"] == pytest.approx(1.25 / 2)

"""Dynamic sampling's accounting against hand-counted sequences of kept and dropped groups."""

from __future__ import annotations

import math

import pytest

from asyncgrpo.rollout.dynamic_sampling import OverSamplingCount


def test_over_sampling_factor_and_the_cap():
    count = OverSamplingCount(max_factor=3.0)
    assert math.isnan(count.factor)
    # Step 1: dropped, dropped, kept -> 3 generated for 1 kept: at the cap, not over; a 4th dropped passes it.
    for kept in (False, False):
        count.on_group(kept)
        assert not count.over_cap  # none kept: never over the cap (the step keeps pulling)
    count.on_group(True)
    assert count.factor == 3.0 and not count.over_cap
    count.on_group(False)
    assert count.over_cap
    line = count.stop(step=7, held_samples=8)
    assert line.startswith("step 7: dynamic sampling stopped filling the step: 4 groups generated for 1 kept")
    assert "over dynamic_sampling_max_factor=3;" in line and "trains the 8 samples it holds" in line
    assert dict(count.close_step()) == {
        "dynamic_sampling/generated_groups": 4.0,
        "dynamic_sampling/kept_groups": 1.0,
        "dynamic_sampling/generated_per_kept": 4.0,
        "dynamic_sampling/cap_hit": 1.0,
    }
    # Step 2 starts from zero: 2 kept of 3 -> 1.5 per kept; none kept -> the factor is left out.
    for kept in (True, False, True):
        count.on_group(kept)
    expected = {"dynamic_sampling/generated_groups": 3.0, "dynamic_sampling/kept_groups": 2.0,
                "dynamic_sampling/generated_per_kept": 1.5, "dynamic_sampling/cap_hit": 0.0}  # fmt: skip
    assert dict(count.close_step()) == pytest.approx(expected)
    count.on_group(False)
    assert count.factor == math.inf
    assert "dynamic_sampling/generated_per_kept" not in dict(count.close_step())
    with pytest.raises(ValueError, match=">= 1"):
        OverSamplingCount(max_factor=0.5)


def test_with_the_switch_off_no_step_is_over_the_cap():
    count = OverSamplingCount(max_factor=1.0, enforce_cap=False)
    for kept in (True, False, False, False):
        count.on_group(kept)
    assert count.factor == 4.0 and not count.over_cap  # the natural tie rate: 4 generated per kept

"""Dynamic sampling's accounting against hand-counted sequences of kept and dropped groups."""

from __future__ import annotations

import math

import pytest

from asyncgrpo.rollout.dynamic_sampling import OverSamplingCount


def test_over_sampling_factor_and_the_cap_line():
    count = OverSamplingCount(max_factor=3.0)
    assert math.isnan(count.factor)
    # Step 1: dropped, dropped, kept, dropped -> 4 generated for 1 kept; 4 > 3 * 1 on the 4th group.
    lines = [count.on_group(k) for k in (False, False, True)]
    assert lines == [None, None, None] and count.factor == 3.0
    line = count.on_group(False)
    assert line is not None and "4 groups generated for 1 kept" in line and "cap of 3" in line
    assert count.on_group(False) is None  # the line comes once per step
    assert dict(count.close_step()) == {
        "dynamic_sampling/generated_groups": 5.0,
        "dynamic_sampling/kept_groups": 1.0,
        "dynamic_sampling/generated_per_kept": 5.0,
        "dynamic_sampling/cap_hit": 1.0,
    }
    # Step 2 starts from zero: 2 kept of 3 -> 1.5 per kept, no line; none kept -> the factor is left out.
    assert [count.on_group(k) for k in (True, False, True)] == [None, None, None]
    assert dict(count.close_step())["dynamic_sampling/generated_per_kept"] == pytest.approx(1.5)
    count.on_group(False)
    assert count.factor == math.inf
    assert "dynamic_sampling/generated_per_kept" not in dict(count.close_step())
    with pytest.raises(ValueError, match=">= 1"):
        OverSamplingCount(max_factor=0.5)

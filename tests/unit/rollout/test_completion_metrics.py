"""completions/* metrics of finished groups, reduced over a logging window and checked by hand."""

from __future__ import annotations

import pytest

from asyncgrpo.metrics import MetricsWindow, is_documented_metric
from asyncgrpo.rollout.completion_metrics import completion_metric_events
from asyncgrpo.types import Rollout, TurnRecord


def _rollout(ids: list[int], turns: int = 1, tool_calls: int = 0) -> Rollout:
    turn = TurnRecord(prompt_ids=[1], output_ids=ids, output_log_probs=[0.0] * len(ids))
    return Rollout(completion=[], completion_ids=ids, turns=[turn] * turns, tool_call_count=tool_calls)


def test_group_metrics_average_over_rollouts_across_groups():
    window = MetricsWindow()
    # Group 1: lengths 2, 2 (identical), 4 (truncated); one rollout made 3 tool calls over 2 turns.
    g1 = [_rollout([5, 6]), _rollout([5, 6]), _rollout([7, 8, 9, 10], turns=2, tool_calls=3)]
    window.extend(completion_metric_events(g1, ["stop", "stop", "length"]))
    # Group 2: lengths 1 and 6, both ended with EOS.
    g2 = [_rollout([4]), _rollout([1, 2, 3, 4, 5, 6])]
    window.extend(completion_metric_events(g2, ["stop", "stop"]))
    m = window.flush()
    assert m["completions/mean_length"] == pytest.approx((2 + 2 + 4 + 1 + 6) / 5)
    assert (m["completions/min_length"], m["completions/max_length"]) == (1, 6)
    assert m["completions/mean_terminated_length"] == pytest.approx((2 + 2 + 1 + 6) / 4)
    assert (m["completions/min_terminated_length"], m["completions/max_terminated_length"]) == (1, 6)
    assert m["completions/clipped_ratio"] == pytest.approx(1 / 5)
    assert m["completions/duplicate_frac"] == pytest.approx(1 / 5)
    assert m["rollout/turns_mean"] == pytest.approx(6 / 5) and m["rollout/turns_max"] == 2
    assert "tools/call_frequency" not in m  # logged by the tool metrics, only when the trainer has tools
    assert all(is_documented_metric(name) for name in m)


def test_all_truncated_group_has_no_terminated_lengths_and_bad_input_is_refused():
    names = [name for name, _, _ in completion_metric_events([_rollout([1, 2])], ["length"])]
    assert "completions/mean_terminated_length" not in names
    with pytest.raises(ValueError, match="one finish reason per rollout"):
        completion_metric_events([_rollout([1])], [])

"""StepStats: the step's perf/* metrics, checked against docs/metrics.md's definitions by hand."""

from __future__ import annotations

import time

import pytest

from asyncgrpo.metrics import MetricsWindow, is_documented_metric
from asyncgrpo.trainer.step_stats import StepStats


def test_a_step_records_its_timings_and_rates():
    stats = StepStats(flops_per_token=6.0e6, peak_flops=1.0e12)
    stats.begin()
    stats.micro_batches = ["mb0", "mb1"]
    stats.add_forward_backward(0.5, 300, forward_s=0.2)
    stats.add_forward_backward(0.25, 100, forward_s=0.1)
    stats.optimizer_s = 0.05
    time.sleep(0.8)  # the step's wall time covers at least fwd+bwd
    window = MetricsWindow()
    stats.record(window, trained_tokens=250, world_size=2)
    m = window.flush()
    step_s = m["perf/step_s"]
    assert 0.8 <= step_s < 30
    assert m["perf/fwd_bwd_s"] == pytest.approx(0.75)
    forwarded = 400 * 2  # this process's tokens × processes
    assert m["perf/fwd_s"] == pytest.approx(0.3)
    assert m["perf/optimizer_s"] == pytest.approx(0.05)
    assert stats.num_tokens_total == forwarded  # num_tokens: a running total, logged by the trainer
    stats.begin()
    stats.add_forward_backward(0.1, 50)
    stats.record(MetricsWindow(), trained_tokens=10, world_size=2)
    assert stats.num_tokens_total == forwarded + 100
    assert m["perf/fwd_bwd_forwarded_tokens_per_s"] == pytest.approx(forwarded / 0.75)
    assert m["perf/wall_clock_forwarded_tokens_per_s"] == pytest.approx(forwarded / step_s)
    assert m["perf/wall_clock_trained_tokens_per_s"] == pytest.approx(250 / step_s)
    assert m["perf/fwd_bwd_mfu"] == pytest.approx(forwarded * 6.0e6 / (0.75 * 1.0e12 * 2))
    assert m["perf/wall_clock_mfu"] == pytest.approx(forwarded * 6.0e6 / (step_s * 1.0e12 * 2))
    assert all(is_documented_metric(name) for name in m)


def test_begin_starts_a_fresh_step_and_mfu_needs_a_known_peak():
    stats = StepStats(flops_per_token=6.0e6, peak_flops=None)
    stats.add_forward_backward(1.0, 10)
    stats.micro_batches = ["old"]
    stats.begin()
    assert (stats.fwd_bwd_s, stats.forwarded_tokens, stats.micro_batches) == (0.0, 0, [])
    window = MetricsWindow()
    stats.record(window, trained_tokens=0, world_size=1)
    m = window.flush()
    assert "perf/fwd_bwd_mfu" not in m and "perf/wall_clock_mfu" not in m  # CPU / unknown device: not logged
    assert stats.num_tokens_total == 0


def test_the_pass_clock_splits_forward_from_the_whole_by_the_wall_clock_off_cuda():
    from asyncgrpo.trainer.step_stats import PassClock

    clock = PassClock("cpu")
    time.sleep(0.05)
    clock.forward_done()
    time.sleep(0.1)
    total, forward = clock.finish()
    assert 0.15 <= total < 30 and 0.05 <= forward < total
    assert total - forward >= 0.1  # the backward's share

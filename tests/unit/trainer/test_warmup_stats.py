"""The start-up metrics (issue 41): warm-up share by hand, a real torch.compile recompile, /server_info's ready_s.

The recompile tests compile a real function (``backend="eager"``: dynamo's graph capture and guards, no code
generation) and force a recompile by changing its input's shape or dtype after "step 1".
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from asyncgrpo.metrics import MetricsWindow, is_documented_metric, warmup_share
from asyncgrpo.trainer import recompiles
from asyncgrpo.trainer.server_setup import ready_seconds
from asyncgrpo.trainer.warmup_stats import StartupMetrics, process_start_time

IMPORTED_AT = time.time()


def test_warmup_share_by_hand():
    durations = [10.0, 1.0, 1.2, 0.9, 5.0, 1.0]
    # median (1.0 + 1.2) / 2 = 1.1, so steps above 2.2 s are warm-up: 10 and 5 of 19.1 s
    assert warmup_share(durations) == pytest.approx(15.0 / 19.1)
    assert warmup_share([1.0, 1.0, 1.0]) == 0.0
    assert warmup_share([]) == 0.0
    assert warmup_share([3.0]) == 0.0  # one step is its own median


def test_process_start_is_before_this_module_was_imported():
    assert 0 < process_start_time() <= IMPORTED_AT


def _window_after(stats: StartupMetrics, step: int, durations: list[float], will_log: bool = True, **kw):
    window = MetricsWindow()
    stats.step_done(window, step, durations, will_log, **kw)
    return window.flush()


def test_first_step_and_server_ready_are_logged_once():
    stats = StartupMetrics(process_start=time.time() - 30.0)
    first = _window_after(stats, 1, [4.0], server_ready_s=12.5)
    assert 30.0 <= first["perf/time_to_first_step_s"] < 30.0 + 60.0  # a loose upper bound: not a timing figure
    assert first["perf/server_ready_s"] == 12.5
    assert first["perf/warmup_share"] == 0.0
    assert all(is_documented_metric(n) for n in first)
    second = _window_after(stats, 2, [4.0, 1.0, 1.0], server_ready_s=12.5)
    assert "perf/time_to_first_step_s" not in second and "perf/server_ready_s" not in second
    assert second["perf/warmup_share"] == pytest.approx(4.0 / 6.0)
    quiet = _window_after(stats, 3, [4.0, 1.0, 1.0, 1.0], will_log=False)
    assert "perf/warmup_share" not in quiet  # the run-so-far figure goes only into a window that is logged


def test_no_server_ready_without_the_field():
    assert "perf/server_ready_s" not in _window_after(StartupMetrics(), 1, [1.0], server_ready_s=None)


def test_ready_s_is_read_from_the_servers_own_section():
    embedded = {"vllm_config": {"model_config": {"dtype": "torch.float32"}}, "asyncgrpo": {"kv_cache_tokens": 16384,
                "weight_version": "step-0", "engine_pid": 4242, "ready_s": 38.7}}  # fmt: skip
    assert ready_seconds(embedded) == 38.7
    vllm = {"vllm_config": {"model_config": {"dtype": "torch.bfloat16"}}, "vllm_env": {"VLLM_SERVER_DEV_MODE": "1"}}
    assert ready_seconds(vllm) is None
    assert ready_seconds({"asyncgrpo": {"ready_s": None}}) is None
    assert ready_seconds({"asyncgrpo": {"ready_s": True}}) is None


def _compiled():
    def scaled_sine(x):
        return torch.sin(x) * 2.0

    return torch.compile(scaled_sine, backend="eager")


def test_a_recompile_after_step_one_is_counted_with_its_cause(caplog):
    f = _compiled()
    stats = StartupMetrics()
    f(torch.ones(3))  # step 1 compiles: warm-up, not counted
    first = _window_after(stats, 1, [2.0])
    assert first["perf/recompiles"] == 0
    f(torch.ones(3))  # the same guards hold: no new graph
    assert _window_after(stats, 2, [2.0, 1.0])["perf/recompiles"] == 0
    with caplog.at_level(logging.WARNING, logger=recompiles.__name__):
        f(torch.ones(5))  # another size: the guard on x's shape fails, dynamo compiles again
        third = _window_after(stats, 3, [2.0, 1.0, 1.0])
    assert third["perf/recompiles"] == 1
    (record,) = [r for r in caplog.records if r.name == recompiles.__name__]
    text = record.getMessage()
    assert "scaled_sine" in text and "by step 3" in text
    assert "tensor 'x' size mismatch at index 0. expected 3, actual 5" in text
    caplog.clear()
    f(torch.ones(7))  # now compiled with a dynamic size: no recompile, no warning
    assert _window_after(stats, 4, [2.0, 1.0, 1.0, 1.0])["perf/recompiles"] == 1
    assert not [r for r in caplog.records if r.name == recompiles.__name__]


def test_without_dynamos_failure_table_the_cause_is_unknown(caplog, monkeypatch):
    import torch._dynamo.utils as dynamo_utils

    f = _compiled()
    stats = StartupMetrics()
    f(torch.ones(2))
    _window_after(stats, 1, [1.0])
    monkeypatch.setattr(dynamo_utils, "guard_failures", None)  # another torch keeps it elsewhere, or not at all
    with caplog.at_level(logging.WARNING, logger=recompiles.__name__):
        f(torch.ones(2, dtype=torch.float64))
        assert _window_after(stats, 2, [1.0, 1.0])["perf/recompiles"] == 1
    assert "cause unknown" in caplog.text

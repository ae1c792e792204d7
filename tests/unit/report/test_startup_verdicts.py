"""The warm-up and fixed-cost tables of the run doctor, and the start-up line of the run summary (issue 41).

Windows are built by hand, one per step as with ``logging_steps=1``; each expected figure is computed here.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncgrpo.report import RunLog, diagnose, load_run
from asyncgrpo.report.live import summary

REAL_RUN = Path(__file__).resolve().parents[3] / "tests" / "data" / "two_gpu_run_h200x2"  # bench/two_gpu_run.py's run


def _windows(step_s: list[float], **series: float) -> list[dict[str, float]]:
    return [{"step": float(i), "perf/step_s": s, **{k.replace("__", "/"): v for k, v in series.items()}}
            for i, s in enumerate(step_s, 1)]  # fmt: skip


def _verdict(windows: list[dict[str, float]], table: str):
    found = [v for v in diagnose(RunLog(windows)) if v.table == table]
    return found[0] if found else None


def test_warmup_fires_when_slow_steps_take_more_than_a_fifth():
    # 2 steps of 20 s and 18 of 1 s: median 1 s, slow steps 40 s of 58 s = 69 %
    windows = _windows([20.0, 20.0] + [1.0] * 18)
    windows[0]["perf/time_to_first_step_s"] = 61.0
    windows[0]["perf/server_ready_s"] = 38.0
    v = _verdict(windows, "warm-up")
    assert v is not None and not v.healthy
    assert "warm-up took 69 % of the training time" in v.diagnosis
    assert "TORCHINDUCTOR_CACHE_DIR" in v.action and "perf/recompiles" in v.action and "max_steps" in v.action
    assert v.figures["slow steps"] == "2 of 20 above 2x the median step 1 s, 40 s of 58 s"
    assert v.figures["perf/time_to_first_step_s"] == "61 s" and v.figures["perf/server_ready_s"] == "38 s"


def test_warmup_prefers_the_trainers_own_share():
    windows = _windows([20.0, 20.0] + [1.0] * 18)
    windows[-1]["perf/warmup_share"] = 0.15  # measured on every step's own time: below a fifth
    v = _verdict(windows, "warm-up")
    assert v.healthy and v.figures["perf/warmup_share"] == "15 %"


def test_warmup_quiet_on_a_long_run():
    # the same 40 s of warm-up over 400 steps of 1 s: 40 / 438 = 9 %
    v = _verdict(_windows([20.0, 20.0] + [1.0] * 398), "warm-up")
    assert v.healthy and v.figures["perf/warmup_share"].startswith("9 %")


def test_windows_of_several_steps_stand_for_their_steps():
    # logging_steps=5: windows at 5, 10, 15 of means 9, 1, 1 -> 15 steps; 5 x 9 s of 55 s are slow
    windows = [
        {"step": 5.0, "perf/step_s": 9.0},
        {"step": 10.0, "perf/step_s": 1.0},
        {"step": 15.0, "perf/step_s": 1.0},
    ]
    v = _verdict(windows, "warm-up")
    assert not v.healthy and v.figures["slow steps"] == "5 of 15 above 2x the median step 1 s, 45 s of 55 s"


def test_fixed_cost_fires_on_a_short_step_far_from_peak():
    # 900 tokens a step in 0.15 s at 0.5 % of peak: launches and Python, not FLOPs
    windows = _windows([0.25] * 10, perf__fwd_bwd_s=0.15, perf__fwd_bwd_mfu=0.005, batch__forwarded_tokens_per_step=900.0,
                       perf__fwd_bwd_forwarded_tokens_per_s=6000.0)  # fmt: skip
    v = _verdict(windows, "fixed cost")
    assert not v.healthy and "dominated by fixed cost" in v.diagnosis and "200x the time its FLOPs need" in v.diagnosis
    assert "token_budget" in v.action and "compile_decoder_layers=True" in v.action
    assert v.figures["fwd+bwd per forwarded token"] == "167 us"  # 1e6 / 6000


def test_fixed_cost_quiet_on_long_or_efficient_steps():
    long_step = _windows([3.0] * 10, perf__fwd_bwd_s=2.5, perf__fwd_bwd_mfu=0.01)
    assert _verdict(long_step, "fixed cost").healthy  # slow, but not for fixed cost (many tokens, long rows)
    efficient = _windows([0.3] * 10, perf__fwd_bwd_s=0.2, perf__fwd_bwd_mfu=0.3)
    assert _verdict(efficient, "fixed cost").healthy
    assert _verdict(_windows([0.3] * 10, perf__fwd_bwd_s=0.2), "fixed cost") is None  # no MFU (CPU, unknown GPU)


def test_real_two_gpu_run_warmup_share_by_hand():
    """The measured H200 run (one window per step): steps 1, 2 and 9 took ~14 s against a median of 0.7 s."""
    rows = [json.loads(line) for line in (REAL_RUN / "metrics.jsonl").read_text().splitlines()]
    step_s = sorted(r["perf/step_s"] for r in rows if "perf/step_s" in r)
    n = len(step_s)
    median = step_s[n // 2] if n % 2 else (step_s[n // 2 - 1] + step_s[n // 2]) / 2
    slow = [s for s in step_s if s > 2 * median]
    v = next(v for v in diagnose(load_run(REAL_RUN)) if v.table == "warm-up")
    assert not v.healthy and v.figures["perf/warmup_share"].startswith(f"{100 * sum(slow) / sum(step_s):.0f} %")
    assert v.figures["slow steps"].startswith(f"{len(slow)} of {n} above")


def test_summary_shows_the_startup_figures():
    windows = _windows([20.0, 1.0, 1.0], reward=0.5)
    windows[0].update({"perf/time_to_first_step_s": 61.04, "perf/server_ready_s": 38.2})
    windows[-1].update({"perf/warmup_share": 0.8696, "perf/recompiles": 2.0})
    text = summary(windows, 3, 90.0, "out")
    done, startup = text.splitlines()
    assert done.startswith("done: reward 0.5 -> 0.5") and done.endswith("saved to out")
    assert startup == ("start-up: first step 61.0 s after launch, server ready in 38.2 s; warm-up 87 % of training "
                       "time (steps slower than 2x the median); 2 recompiles after step 1")  # fmt: skip
    assert summary(_windows([1.0], reward=0.5), 1, 5.0, None).count("\n") == 0  # nothing logged: one line


def test_warmup_spent_waiting_for_samples_is_named_so():
    # steps 1 and 3 took 3 s, 2.5 of them waiting for rollouts; the rest 0.5 s: generation's start, not compiles
    windows = _windows([3.0, 0.5, 3.0, 0.5, 0.5, 0.5], perf__rollout_wait_s=0.0)
    for w in (windows[0], windows[2]):
        w["perf/rollout_wait_s"] = 2.5
    v = _verdict(windows, "warm-up")
    assert not v.healthy and "mostly waiting for samples" in v.diagnosis
    assert "TORCHINDUCTOR_CACHE_DIR" not in v.action and "max_steps" in v.action
    assert v.figures["perf/rollout_wait_s in slow steps"] == "5 s"


def test_slow_steps_all_through_the_run_that_wait_are_not_called_warm_up():
    # A generation-bound cadence: two steps of 0.07 s, then one of 0.2 s that waited 0.13 s, ten times over.
    # Median 0.07 s; the ten slow steps take 2.0 s of 3.4 s (59 %), 1.3 s of it waiting, 5 of them in the second half.
    windows = _windows([0.07, 0.07, 0.2] * 10, perf__rollout_wait_s=0.0)
    for w in windows[2::3]:
        w["perf/rollout_wait_s"] = 0.13
    v = _verdict(windows, "warm-up")
    assert not v.healthy and v.diagnosis.startswith("not a warm-up: 59 % of the training time")
    assert "generation-bound" in v.diagnosis and "(1.3 s of 2 s)" in v.diagnosis
    assert v.action.startswith("raise max_staleness") and "TORCHINDUCTOR_CACHE_DIR" not in v.action
    assert v.figures["slow steps in the run's second half"] == "5 of 10"

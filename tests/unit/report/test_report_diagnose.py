"""The run doctor's verdicts: one synthetic metrics.jsonl per row of the diagnosis tables (docs/metrics.md).

Each file is built so that the row's words hold by a wide margin (e.g. "queue nearly empty" = 2 samples
against 100 per step), and the test checks that exactly that row is picked, with the figures it rests on.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncgrpo.report import diagnose, load_run

Series = float | Callable[[int], float]


def write_run(tmp_path: Path, steps: int = 30, config: dict | None = None, **series: Series) -> Path:
    """metrics.jsonl with one window per step; keys use '__' for '/' (e.g. perf__step_s)."""
    lines = []
    for step in range(1, steps + 1):
        row = {"step": step, "time": 1000.0 + step}
        for key, value in series.items():
            row[key.replace("__", "/")] = value(step) if callable(value) else value
        lines.append(json.dumps(row))
    lines.append(json.dumps({"step": steps, "train_runtime": 12.0, "train_loss": 0.1}))  # transformers' summary
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if config is not None:
        (tmp_path / "run_config.json").write_text(json.dumps({"args": config}))
    return tmp_path


def verdict(run_dir: Path, table: str, last: int = 50, **overrides):
    found = [v for v in diagnose(load_run(run_dir, **overrides), last) if v.table == table]
    assert len(found) == 1, found
    return found[0]


# ---- queue table -----------------------------------------------------------------------------------------------------
QUEUE_BASE = {"perf__step_s": 2.0, "batch__samples_per_step": 100.0, "batch__groups_per_step": 12.0}


def test_queue_generation_bound(tmp_path):
    run = write_run(
        tmp_path, **QUEUE_BASE, perf__rollout_wait_s=1.74, rollout__queue_size=2.0, rollout__backpressure_s=0.0
    )
    v = verdict(run, "queue")
    assert "generation-bound" in v.diagnosis and not v.healthy
    assert "87 %" in v.diagnosis and "rollout/generated_tokens_per_s" in v.action  # 1.74 / 2.0
    assert v.figures["rollout/queue_size"] == "2 samples = 0.02 steps"


def test_queue_trainer_bound(tmp_path):
    run = write_run(
        tmp_path,
        **QUEUE_BASE,
        perf__rollout_wait_s=0.0,
        rollout__queue_size=350.0,
        rollout__backpressure_s=1.0,
        config={"max_staleness": 4},
    )
    v = verdict(run, "queue")
    assert "trainer-bound" in v.diagnosis and v.healthy
    assert v.figures["max_staleness"] == "4" and v.figures["rollout/queue_size"] == "350 samples = 3.50 steps"


def test_queue_max_staleness_too_tight(tmp_path):
    run = write_run(
        tmp_path, **QUEUE_BASE, perf__rollout_wait_s=0.8, rollout__queue_size=5.0, rollout__backpressure_s=0.6
    )
    v = verdict(run, "queue")
    assert "max_staleness itself is too tight" in v.diagnosis and v.action == "raise max_staleness"
    assert v.figures["rollout/backpressure_s"] == "30 % of a step per group start"


def test_queue_balanced(tmp_path):
    run = write_run(
        tmp_path, **QUEUE_BASE, perf__rollout_wait_s=0.01, rollout__queue_size=60.0, rollout__backpressure_s=0.02
    )
    assert "balanced" in verdict(run, "queue").diagnosis


def test_queue_median_ignores_one_slow_step(tmp_path):
    """A 60 s checkpoint step must not dilute 87 % waiting in every other step."""
    base = {**QUEUE_BASE, "perf__step_s": lambda s: 60.0 if s == 10 else 2.0}
    run = write_run(tmp_path, **base, perf__rollout_wait_s=1.74, rollout__queue_size=2.0, rollout__backpressure_s=0.0)
    assert "87 %" in verdict(run, "queue").diagnosis


# Steps 3-30 of a measured run (bench/results/time_to_learning_h100.json, async_warm at 2f585a9: SmolLM2-135M shape,
# server and trainer on one H100): generation-bound, and the waits come every second or third step.
H100_STEP_S = [0.161, 0.0629, 0.1426, 0.1123, 0.064, 0.1181, 0.0614, 0.0636, 0.1385, 0.0719, 0.073, 0.1361, 0.067,
               0.1034, 0.1647, 0.0593, 0.0719, 0.1694, 0.0684, 0.078, 0.2348, 0.058, 0.0698, 0.1383, 0.0731, 0.065,
               0.1427, 0.0682]  # fmt: skip
H100_WAIT_S = [0.1075, 0.0004, 0.0907, 0.0517, 0.0005, 0.0546, 0.0005, 0.0005, 0.0739, 0.0007, 0.0008, 0.068, 0.0006,
               0.0189, 0.0956, 0.0006, 0.0005, 0.0712, 0.0006, 0.0006, 0.066, 0.0005, 0.0006, 0.069, 0.0007, 0.0005,
               0.0724, 0.0006]  # fmt: skip


def test_queue_sees_waits_that_alternate_between_steps(tmp_path):
    """Fewer than half the steps wait, so the median share is near zero; the mean of the shares is not."""
    shares = sorted(w / s for w, s in zip(H100_WAIT_S, H100_STEP_S))
    median = (shares[13] + shares[14]) / 2
    mean = sum(shares) / len(shares)
    assert median < 0.05 and mean > 0.2  # the run this test is about
    run = write_run(tmp_path, steps=len(H100_STEP_S), perf__step_s=lambda s: H100_STEP_S[s - 1],
                    perf__rollout_wait_s=lambda s: H100_WAIT_S[s - 1], rollout__queue_size=0.0,
                    batch__samples_per_step=16.0, rollout__backpressure_s=0.0)  # fmt: skip
    v = verdict(run, "queue")
    assert "generation-bound" in v.diagnosis and not v.healthy
    assert f"waited {100 * mean:.0f} %" in v.diagnosis
    assert v.figures["perf/rollout_wait_s"] == (
        f"{100 * median:.0f} % of a step (median of the last 28 windows; mean {100 * mean:.0f} %)"
    )


# ---- concurrency table -----------------------------------------------------------------------------------------------
def test_concurrency_staleness_limit(tmp_path):
    run = write_run(
        tmp_path,
        perf__step_s=1.0,
        perf__rollout_wait_s=0.0,
        rollout__backpressure_s=0.4,
        rollout__concurrency=40.0,
        rollout__concurrency_cap=512.0,
        rollout__vllm_kv_cache_usage_frac=0.2,
    )
    v = verdict(run, "concurrency")
    assert "staleness limit" in v.diagnosis and v.healthy


def test_concurrency_server_load(tmp_path):
    run = write_run(
        tmp_path,
        perf__step_s=1.0,
        perf__rollout_wait_s=0.5,
        rollout__backpressure_s=0.0,
        rollout__concurrency=95.0,
        rollout__concurrency_cap=100.0,
        rollout__vllm_kv_cache_usage_frac=0.85,
    )
    v = verdict(run, "concurrency")
    assert "server's load" in v.diagnosis and not v.healthy
    assert v.figures["rollout/concurrency_cap"] == "100" and v.figures["max_concurrent_rollouts"] == "512"


def test_concurrency_user_cap(tmp_path):
    run = write_run(
        tmp_path,
        perf__step_s=1.0,
        perf__rollout_wait_s=0.6,
        rollout__backpressure_s=0.0,
        rollout__concurrency=64.0,
        rollout__concurrency_cap=64.0,
        rollout__vllm_kv_cache_usage_frac=0.3,
        config={"max_concurrent_rollouts": 64},
    )
    v = verdict(run, "concurrency")
    assert "raise max_concurrent_rollouts" in v.action and not v.healthy
    assert v.figures["rollout/vllm_kv_cache_usage_frac"] == "30 %"


# ---- saturation table ------------------------------------------------------------------------------------------------
def test_saturation_healthy(tmp_path):
    run = write_run(
        tmp_path,
        frac_reward_zero_std=lambda s: 0.1 + 0.05 * (s % 2),
        reward_dropped=0.5,
        reward=lambda s: 0.3 + 0.01 * s,
    )
    v = verdict(run, "saturation")
    assert v.diagnosis.startswith("healthy") and v.healthy


def test_saturation_top(tmp_path):
    run = write_run(
        tmp_path, frac_reward_zero_std=lambda s: 0.2 + 0.02 * s, reward_dropped=0.95, reward=lambda s: 0.5 + 0.015 * s
    )
    v = verdict(run, "saturation")
    assert "saturating at the top" in v.diagnosis and "harder prompts" in v.action
    assert v.figures["reward range"] == "[0, 1]"


def test_saturation_bottom_points_at_clipping(tmp_path):
    run = write_run(
        tmp_path, frac_reward_zero_std=0.9, reward_dropped=0.02, reward=0.03, completions__clipped_ratio=0.6
    )
    v = verdict(run, "saturation")
    assert "stuck at the bottom" in v.diagnosis and "max_completion_length" in v.action
    assert v.figures["completions/clipped_ratio"] == "0.6"


def test_saturation_regression(tmp_path):
    run = write_run(
        tmp_path,
        frac_reward_zero_std=lambda s: 0.2 + 0.02 * s,
        reward_dropped=lambda s: 0.9 - 0.02 * s,
        reward=lambda s: 0.8 - 0.02 * s,
    )
    v = verdict(run, "saturation")
    assert v.diagnosis.startswith("regression") and "duplicate_frac" in v.action and not v.healthy


def test_saturation_mixed(tmp_path):
    run = write_run(tmp_path, frac_reward_zero_std=0.7, reward_dropped=0.5, reward=0.5)
    assert verdict(run, "saturation").diagnosis.startswith("mixed")


def test_saturation_reward_range_option(tmp_path):
    """Rewards on [0, 10]: a dropped reward of 9.5 is the top, 0.5 would be the bottom."""
    run = write_run(tmp_path, frac_reward_zero_std=0.8, reward_dropped=0.5, reward=0.4)
    assert "stuck at the bottom" in verdict(run, "saturation", reward_range=(0, 10)).diagnosis


# ---- duplicates table ------------------------------------------------------------------------------------------------
def test_duplicates_healthy(tmp_path):
    run = write_run(tmp_path, completions__duplicate_frac=0.01, entropy=1.5)
    assert verdict(run, "duplicates").diagnosis.startswith("healthy")


def test_duplicates_not_random(tmp_path):
    run = write_run(
        tmp_path,
        completions__duplicate_frac=lambda s: 0.01 if s < 25 else 0.85,
        entropy=1.0,
        config={"num_generations": 8},
    )
    v = verdict(run, "duplicates", last=5)
    assert "no longer random" in v.diagnosis and "temperature" in v.action
    assert v.figures["(num_generations - 1) / num_generations"] == "0.875"


def test_duplicates_collapse(tmp_path):
    run = write_run(tmp_path, completions__duplicate_frac=lambda s: 0.01 * s, entropy=lambda s: 2.0 - 0.05 * s)
    v = verdict(run, "duplicates")
    assert v.diagnosis.startswith("collapse") and not v.healthy


# ---- input errors ----------------------------------------------------------------------------------------------------
def test_missing_or_empty_metrics(tmp_path):
    with pytest.raises(ValueError, match="metrics.jsonl not found: pass the run's output_dir"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "train_runtime": 1.0}) + "\n")
    with pytest.raises(ValueError, match="no logging window yet"):
        load_run(tmp_path)


# ---- a real run ------------------------------------------------------------------------------------------------------
REAL_RUN = Path(__file__).resolve().parents[3] / "tests" / "data" / "two_gpu_run_h200x2"  # bench/two_gpu_run.py's run


def test_real_two_gpu_run(tmp_path):
    """The measured H200 run: the queue figure is the median per-window wait share, recomputed here by hand."""
    from asyncgrpo.report import write_report

    rows = [json.loads(line) for line in (REAL_RUN / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in rows if "train_runtime" not in r and "perf/step_s" in r]
    shares = sorted(r["perf/rollout_wait_s"] / r["perf/step_s"] for r in windows)
    mid = len(shares) // 2
    median = shares[mid] if len(shares) % 2 else (shares[mid - 1] + shares[mid]) / 2
    run = load_run(REAL_RUN, num_generations=8)
    verdicts = write_report(run, tmp_path)
    queue = next(v for v in verdicts if v.table == "queue")
    assert queue.figures["perf/rollout_wait_s"].startswith(f"{100 * median:.0f} % of a step")
    assert {v.table for v in verdicts} == {"queue", "concurrency", "saturation", "duplicates", "sampler mismatch",
                                           "warm-up", "fixed cost"}  # fmt: skip
    assert next(v for v in verdicts if v.table == "sampler mismatch").healthy  # masked_mean is 0 there
    assert (tmp_path / "report.html").is_file() and len(list(tmp_path.glob("*.png"))) >= 10


# ---- the verdicts as a whole (issue 30, item 6) ----------------------------------------------------------------------
def _grid_runs():
    """Runs over a grid of waits, queue fill, concurrency and reward patterns, including the issue's report: the
    trainer waits on an empty queue while generation is held back a little now and then."""
    import itertools

    from asyncgrpo.report import RunLog, RunSettings

    waits, blocks, queues = (0.0, 0.1, 0.5), (0.0, 0.02, 0.1, 0.5), (2.0, 350.0)
    conc = ((40.0, 512.0, 0.2), (95.0, 100.0, 0.85), (64.0, 64.0, 0.3))
    rewards = ((0.0, lambda s: 0.1), (0.8, lambda s: 0.05), (0.1, lambda s: 0.1 + 0.02 * s))
    for wait, blocked, queue, (c, cap, kv), (zs, reward) in itertools.product(waits, blocks, queues, conc, rewards):
        windows = [{"step": float(s), "perf/step_s": 1.0, "perf/rollout_wait_s": wait, "rollout/backpressure_s": blocked,
                    "rollout/queue_size": queue, "batch/samples_per_step": 100.0, "rollout/concurrency": c,
                    "rollout/concurrency_cap": cap, "rollout/vllm_kv_cache_usage_frac": kv,
                    "frac_reward_zero_std": zs, "reward": reward(s), "reward_dropped": 0.0,
                    "completions/duplicate_frac": 0.02, "entropy": 1.0} for s in range(1, 31)]  # fmt: skip
        settings = dataclasses.replace(RunSettings(), max_concurrent_rollouts=64 if cap == 64.0 else 512)
        yield RunLog(windows, settings)


def test_no_verdict_contradicts_another_and_every_action_names_a_setting():
    from asyncgrpo.config import AsyncGRPOConfig

    settings = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    flag = re.compile(r"--[a-z][a-z-]+")
    seen_generation_bound = 0
    for run in _grid_runs():
        verdicts = diagnose(run)
        text = " ".join(v.text() for v in verdicts)
        generation_bound = any("generation-bound" in v.diagnosis for v in verdicts)
        seen_generation_bound += generation_bound
        if generation_bound:  # then nothing may call the run trainer-bound or inference faster than training
            assert "trainer-bound" not in text and "inference is faster than training" not in text, text
        for v in verdicts:
            assert "between rows" not in v.diagnosis
            named = any(s in v.action for s in settings) or flag.search(v.action)
            assert v.action.startswith("nothing to") or named, v.text()
            if v.action.startswith("nothing to"):
                assert v.healthy, v.text()  # an unhealthy verdict always says what to change
    assert seen_generation_bound > 10


# ---- sampler mismatch table ------------------------------------------------------------------------------------------
def test_sampler_mismatch_masking_too_much(tmp_path):
    run = write_run(tmp_path, sampling__masked_mean=0.3, sample__staleness_mean=3.5)
    v = verdict(run, "sampler mismatch")
    assert not v.healthy and "removes 30 % of the trained tokens" in v.diagnosis
    assert "max_staleness" in v.action and "bf16" in v.action
    assert v.figures["sample/staleness_mean"] == "3.5"


def test_sampler_mismatch_truncating_too_much(tmp_path):
    run = write_run(tmp_path, sampling__masked_mean=0.0, sampling__truncated_mean=0.4)
    v = verdict(run, "sampler mismatch")
    assert not v.healthy and "clamps the weight of 40 %" in v.diagnosis


def test_sampler_mismatch_healthy(tmp_path):
    v = verdict(write_run(tmp_path, sampling__masked_mean=0.02), "sampler mismatch")
    assert v.healthy and v.figures["sampling/masked_mean"] == "2 %"


# ---- MoE routing table -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("series", "config", "diagnosis", "healthy"),
    [
        ({"aux_loss": 1.0, "sampling__sampling_logp_difference__mean": 0.003}, None, "log-probs agree", True),
        ({"aux_loss": 1.0, "sampling__sampling_logp_difference__mean": 0.08}, None, "routing mismatch", False),
        ({"sampling__sampling_logp_difference__mean": 0.08, "moe__router_disagreement__mean": 0.15,
          "moe__router_disagreement__max": 0.3}, {"router_replay": False}, "routing mismatch", False),
        ({"sampling__sampling_logp_difference__mean": 0.08, "moe__router_disagreement__mean": 0.004,
          "moe__router_disagreement__max": 0.01}, None, "routers mostly agree", False),
        ({"sampling__sampling_logp_difference__mean": 0.08, "moe__router_disagreement__mean": 0.15},
         {"router_replay": True}, "although routing is replayed", False),
    ],
)  # fmt: skip
def test_routing_rows(tmp_path, series, config, diagnosis, healthy):
    v = verdict(write_run(tmp_path, config=config, **series), "routing")
    assert diagnosis in v.diagnosis and v.healthy is healthy
    if not healthy and "mismatch" in diagnosis:
        assert "router_replay=True" in v.action and "--enable-return-routed-experts" in v.action


def test_no_routing_verdict_for_a_dense_model(tmp_path):
    run = write_run(tmp_path, sampling__sampling_logp_difference__mean=0.08)
    assert not [v for v in diagnose(load_run(run)) if v.table == "routing"]

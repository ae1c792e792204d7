"""bench/rollout_path.py on the CPU (``--tiny``): all three variants run and report what they generated.

The numbers are not speed measurements here; the test checks the script end to end (the engine in process,
a real ``asyncgrpo serve`` subprocess, the spawned rollout worker) and that a failing run exits non-zero.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # runs a bench script end to end: `make test-long`

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "rollout_path.py"


def _run(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run([sys.executable, str(SCRIPT), "--tiny", *args], cwd=tmp_path, env=env, capture_output=True, check=False,
                          text=True, timeout=timeout)  # fmt: skip


def test_tiny_run_reports_every_variant_and_shape(tmp_path):
    out = tmp_path / "result.json"
    # b5 (distinct prompts) and grpo_n (shared prompts, every variant); grpo differs from grpo_n only in lengths
    proc = _run(tmp_path, "--shapes", "b5,grpo_n", "--out", str(out), "--max-seconds", "240", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["failures"] == [] and result["logprobs"] == 8
    for shape, info in result["inputs"].items():
        groups, g, _, (o_lo, o_hi), _ = info["shape"]
        expected_requests = groups * g
        rows = [result[v][shape] for v in ("in_process", "http", "worker")]
        assert {r["requests"] for r in rows} == {expected_requests}
        assert [len(r["runs"]) for r in rows] == [3, 3, 3]  # every variant: the median of --repeats (3) runs
        # fixed lengths: every variant generated exactly the same number of tokens, within the shape's range
        assert len({r["generated_tokens"] for r in rows}) == 1
        assert o_lo * expected_requests <= rows[0]["generated_tokens"] <= o_hi * expected_requests
        assert rows[0]["stages"]["decode_steps"] > 0 and rows[1]["stages"]["server_response_build_s"] > 0
        # the answer path's tail: answers are built, parsed (and scored) after the engine's last step
        assert all(r["stages"]["tail_after_last_step_s"] >= 0 for r in rows[1:])
        assert rows[2]["trained_tokens_queued"] > 0  # the worker scored groups and queued training samples
        # the worker's start ramp: its rollouts all started (G3: the first group alone, then the rest) within the run
        ramp = rows[2]["stages"]
        # the child starts right after it reports ready, so its first request may precede start()'s return a little
        assert -0.05 <= ramp["worker_first_request_after_start_s"] <= rows[2]["first_group_s"]
        assert 0 <= ramp["worker_first_group_start_spread_s"] <= rows[2]["first_group_s"]
        assert 0 <= ramp["worker_rest_start_spread_s"] <= rows[2]["seconds"] - rows[2]["first_group_s"]
        group = result["worker_group"].get(shape)  # one request per group: only where groups share prompt and length
        assert (group is not None) == (shape == "grpo_n")
        if group is not None:
            assert group["requests"] == expected_requests and group["generated_tokens"] == rows[0]["generated_tokens"]
            assert group["trained_tokens_queued"] > 0
        # G5: the worker's first cap is the server's KV tokens / max_model_len, and it never ran more than that
        kv = result["kv_cache_tokens"]["server"]
        assert rows[2]["initial_concurrency_cap"] == min(expected_requests, kv // result["max_model_len"])
        assert 0 < rows[2]["max_concurrency"] <= rows[2]["initial_concurrency_cap"]
        grouped = {"worker_group_over_in_process", "worker_group_steady_over_in_process"} if group else set()
        assert set(result["ratios"][shape]) == {"http_over_in_process", "worker_over_in_process",
                                                "worker_steady_over_in_process"} | grouped  # fmt: skip


def test_a_variant_that_fails_makes_the_run_fail(tmp_path):
    """Past --max-seconds the running variant raises: the script says so and exits non-zero."""
    proc = _run(tmp_path, "--variants", "in_process", "--max-seconds", "0.01", timeout=120)
    assert proc.returncode != 0
    assert "FAILED: in_process: TimeoutError" in proc.stderr


def test_the_ramp_splits_the_first_group_from_the_rest():
    """Start stamps of two groups of 3 rollouts, out of order: the first 3 (by time) are the lone first group."""
    sys.path.insert(0, str(ROOT))
    from bench.rollout_server import _ramp

    out = _ramp([10.5, 10.0, 10.2, 12.0, 11.0, 11.4], group_size=3)
    assert out == {"worker_first_group_start_spread_s": 0.5, "worker_rest_start_spread_s": 1.0}
    assert _ramp([], group_size=3) == {}

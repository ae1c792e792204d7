"""bench/probes/engine_start_probe.py on the CPU: a start as the trainer launches it, split as the server logs it."""

from __future__ import annotations

import json
import os
import pstats
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # runs a bench script end to end: `make test-long`

ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_reports_the_split_of_both_processes_and_their_profiles(tmp_path, tiny_llama_dir):
    out = tmp_path / "start.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "probes" / "engine_start_probe.py"), "--out", str(out),
                           "--device", "cpu", "--runs", "1", "--no-trainer", "--cprofile", "--keep-prof", "--model", str(tiny_llama_dir),
                           "--server-args", "--engine-process on --max-model-len 128"], env=env, capture_output=True,
                          text=True, timeout=240, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert run["caches"] == "cold" and "--device" in run["flags"] and run["trainer_side"] is None
    # the log's ready lines and /server_info agree: the same phases, and the same parts of the model load
    lines, info = run["log_ready_lines"], run["start_s"]
    assert list(lines["engine"]["phases"]) == [k for k in info["engine"] if k != "total"]
    assert list(lines["http"]["phases"]) == list(info["http"])
    assert lines["http"]["s"] == pytest.approx(run["ready_s"], abs=0.051)
    load_parts = run["start_parts_s"]["engine"]["load"]
    shown = lines["engine"]["phases"]["load"]["parts"]  # the line shows the parts of 0.05 s and more, rounded
    assert load_parts and all(v == pytest.approx(load_parts[k], abs=0.051) for k, v in shown.items())
    assert {k for k, v in load_parts.items() if v >= 0.06} <= set(shown)  # a fast load may have no part to show
    for role in ("engine", "http"):  # each process profiled its own start
        top = (tmp_path / f"start_run1_{role}_top40.txt").read_text().splitlines()
        assert len(top) == 41 and "profiled" in top[0] and not any("<frozen" in line for line in top)
    assert "_load_tokenizer" in (tmp_path / "start_run1_http_top40.txt").read_text()
    # the engine's profile covers the model load (too fast now to be among the 40 largest entries)
    engine_functions = {fn for _, _, fn in pstats.Stats(str(tmp_path / "start_run1_engine.prof")).stats}  # type: ignore[attr-defined]
    assert "load_any_model" in engine_functions

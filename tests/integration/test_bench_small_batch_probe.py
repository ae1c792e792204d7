"""bench/probes/small_batch_probe.py on the CPU (``--tiny``): every batch is timed, and once more after ``--idle-s``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # runs a bench script end to end: `make test-long`

ROOT = Path(__file__).resolve().parents[2]


def test_idle_runs_are_tagged_and_follow_the_idle_time(tmp_path):
    out = tmp_path / "probe.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "probes" / "small_batch_probe.py"), "--tiny", "--batches", "2",
                           "--idle-s", "1.5", "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    # per log-prob setting (8, then 0): one back-to-back run and one after the idle pause, same batch and tokens
    assert [(r["path"], r["logprobs"]) for r in rows] == [("in_process", 8), ("in_process_after_idle", 8),
                                                          ("in_process", 0), ("in_process_after_idle", 0)]  # fmt: skip
    assert {(r["batch"], r["tokens"]) for r in rows} == {(2, 16)}  # --tiny: 8 output tokens per request
    assert wall >= 2 * 1.5  # both idle pauses were slept (outside the timed runs: each is far shorter)
    assert all(r["seconds"] < 1.5 for r in rows)

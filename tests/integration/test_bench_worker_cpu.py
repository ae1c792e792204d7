"""``bench/worker_cpu.py`` runs end to end (a few groups against its stub server) and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.long]  # runs a bench script end to end: `make test-long`

ROOT = Path(__file__).resolve().parents[2]


def test_small_run_reports_both_modes(tmp_path):
    out = tmp_path / "worker_cpu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "worker_cpu.py"), "--groups", "6", "--lengths", "4",
                           "--repeats", "1", "--port", "18781", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    row = json.loads(out.read_text())["lengths"]["4"]
    for mode in ("g_requests", "one_request"):
        assert len(row[mode]["us_per_sample_runs"]) == 1 and row[mode]["us_per_sample"] > 0
    assert row["speedup"] == row["g_requests"]["us_per_sample"] / row["one_request"]["us_per_sample"]

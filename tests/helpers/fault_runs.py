"""Shared by the fault-matrix test files: start ``fault_scripts/run_trainer.py`` runs, wait for things, read metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "integration" / "fault_scripts"


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"waited {timeout:.0f}s for {what}")


def start_run(tmp_path: Path, server_url: str, model_dir: Path, name: str = "run", **settings) -> subprocess.Popen:
    """Start ``run_trainer.py`` in its own process; its stdout+stderr go to ``<name>/log.txt``."""
    where = tmp_path / name
    where.mkdir(parents=True, exist_ok=True)
    s = {"server_url": server_url, "model_dir": str(model_dir), "output_dir": str(tmp_path / "out"), **settings}
    (where / "settings.json").write_text(json.dumps(s))
    log = open(where / "log.txt", "w")  # noqa: SIM115 - the child writes to it until it ends
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / "run_trainer.py"), str(where / "settings.json")],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )


def metric_rows(tmp_path: Path) -> list[dict]:
    path = tmp_path / "out" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

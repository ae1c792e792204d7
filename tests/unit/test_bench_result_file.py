"""bench/result_file.py: every benchmark JSON starts with the commit, the date and the hardware it was taken on."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path

from bench.result_file import write_result

ROOT = Path(__file__).resolve().parents[2]


def test_write_result_puts_commit_date_and_hardware_first_and_keeps_the_figures(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCGRPO_COMMIT", raising=False)
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    out = tmp_path / "x.json"
    write_result(out, {"tokens_per_s": 61300.0, "runs": [1, 2]}, hardware="1x NVIDIA H200")
    doc = json.loads(out.read_text())
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert list(doc)[:3] == ["commit", "date", "hardware"]
    assert doc["commit"].removesuffix("+dirty") == head
    date = datetime.datetime.fromisoformat(doc["date"])
    assert before <= date <= datetime.datetime.now(datetime.UTC)
    assert doc["hardware"] == "1x NVIDIA H200"
    assert doc["tokens_per_s"] == 61300.0 and doc["runs"] == [1, 2]


def test_a_copied_tree_names_its_commit_through_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCGRPO_COMMIT", "0123abc")
    out = tmp_path / "y.json"
    write_result(out, {"commit": "stale", "value": 1})
    doc = json.loads(out.read_text())
    assert doc["commit"] == "0123abc" and doc["value"] == 1 and doc["hardware"]

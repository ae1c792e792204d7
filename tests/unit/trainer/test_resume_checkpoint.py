"""Which checkpoint a run resumes from, when a kill cut a save short (X3).

A save writes ``rollout_state.json`` last, so a folder without it was cut short and cannot be resumed. These
tests build the folders by hand and check the choice, the errors, and ``metrics.jsonl`` after a fresh restart.
"""

from __future__ import annotations

import json
import logging

import pytest

from asyncgrpo.trainer.checkpoint import prepare_resume, resolve_checkpoint, write_rollout_state


def _checkpoint(out, step: int, complete: bool) -> str:
    path = out / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"")
    if complete:
        (path / "trainer_state.json").write_text("{}")
        write_rollout_state(path, first_untrained_prompt=step, dataset_len=8, step=step)
    return str(path)


def test_true_takes_the_newest_complete_checkpoint(tmp_path, caplog):
    two = _checkpoint(tmp_path, 2, complete=True)
    _checkpoint(tmp_path, 3, complete=False)
    with caplog.at_level(logging.WARNING):
        assert resolve_checkpoint(True, str(tmp_path)) == two
    assert "checkpoint-3" in caplog.text and "checkpoint-2" in caplog.text
    assert resolve_checkpoint("auto", str(tmp_path)) == two


def test_only_a_cut_short_checkpoint(tmp_path, caplog):
    _checkpoint(tmp_path, 1, complete=False)
    with pytest.raises(ValueError, match=r"checkpoint-1 has no rollout_state.json.*'auto'"):
        resolve_checkpoint(True, str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert resolve_checkpoint("auto", str(tmp_path)) is None  # a fresh start
    assert "starting from step 0" in caplog.text


def test_no_checkpoint_at_all(tmp_path):
    assert resolve_checkpoint("auto", str(tmp_path / "missing")) is None
    assert resolve_checkpoint(None, str(tmp_path)) is None and resolve_checkpoint(False, str(tmp_path)) is None
    with pytest.raises(ValueError, match="holds no checkpoint-\\* folder.*'auto'"):
        resolve_checkpoint(True, str(tmp_path))
    with pytest.raises(ValueError, match="is not a directory"):
        resolve_checkpoint(str(tmp_path / "checkpoint-9"), str(tmp_path))


def test_a_fresh_restart_drops_the_earlier_attempts_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 0.1 * s}) for s in (1, 2)]
    metrics.write_text("\n".join(lines) + "\n")
    assert prepare_resume(None, 8, str(tmp_path)).start_index == 0
    assert metrics.read_text().splitlines() == lines  # a plain fresh run leaves the file alone
    assert prepare_resume(None, 8, str(tmp_path), restarted=True).start_index == 0
    assert metrics.read_text() == ""

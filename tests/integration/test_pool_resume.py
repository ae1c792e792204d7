"""Prompt pools across a SIGKILL and a resume (issue 36): the checkpoint holds the pools of exactly what its weights
settled, and the resumed run goes on from it, nothing lost or counted twice.

The trainer runs in its own process (``fault_scripts/run_trainer.py``, the fault harness), against a real
``asyncgrpo serve``; it checkpoints every step. The first attempt is killed once a checkpoint past step 1 is
complete; the second resumes (``resume: auto``) and runs to ``max_steps``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from asyncgrpo.server.launcher import ServerProcess
from tests.helpers.fault_runs import start_run, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.long]  # the long lane: `make test-long`

CONFIG = {"max_steps": 6, "save_strategy": "steps", "save_steps": 1, "max_staleness": 16, "prompt_pools": True,
          "pass_threshold": 0.5, "prompt_pool_min_groups": 1, "prompt_pool_requeue_delay": 4}  # fmt: skip


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir) -> ServerProcess:
    return serve(tiny_llama_dir, "--max-model-len", "256", "--kv-cache-tokens", "16384")


def _states(out: Path) -> dict[int, dict]:
    found = {}
    for ckpt in out.glob("checkpoint-*"):
        path = ckpt / "rollout_state.json"
        if path.is_file():
            found[int(ckpt.name.split("-")[1])] = json.loads(path.read_text())
    return found


def _check_state(state: dict) -> None:
    """A checkpoint's pools count one draw per settled prompt, each draw one group of a dataset row."""
    pools = state["pools"]
    settled_here = sum(outcome != "stale" for outcome in state["settled"].values())
    assert pools["draws"] == state["first_untrained_prompt"] + settled_here, state
    assert sum(pools["groups"].values()) == pools["draws"]
    assert set(pools["rate"]) == set(pools["groups"])
    assert all(0.0 <= r <= 1.0 for r in pools["rate"].values())


def test_pools_state_survives_a_sigkill(tmp_path, server, tiny_llama_dir):
    settings = {"dataset_size": 16, "resume": "auto", "config": CONFIG}
    out = tmp_path / "out"
    proc = start_run(tmp_path, server.base_url, tiny_llama_dir, **settings)
    try:
        wait_for(lambda: proc.poll() is not None or any(s >= 2 for s in _states(out)), 300, "checkpoint-2")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (tmp_path / "run" / "log.txt").read_text()
    assert proc.returncode == -signal.SIGKILL, log[-3000:]
    before = _states(out)
    last = max(before)
    for state in before.values():
        _check_state(state)

    proc = start_run(tmp_path, server.base_url, tiny_llama_dir, **settings)
    assert proc.wait(timeout=600) == 0, (tmp_path / "run" / "log.txt").read_text()[-3000:]
    after = _states(out)
    assert max(after) == CONFIG["max_steps"]
    assert after[last] == before[last]  # the resumed run read that checkpoint, never rewrote it
    for step in range(last + 1, CONFIG["max_steps"] + 1):
        _check_state(after[step])
        # From one checkpoint to the next every row's group count only grows, by the draws the step settled.
        old, new = after[step - 1]["pools"]["groups"], after[step]["pools"]["groups"]
        assert all(new.get(p, 0) >= g for p, g in old.items())
        assert (
            sum(new.values()) - sum(old.values()) == after[step]["pools"]["draws"] - after[step - 1]["pools"]["draws"]
        )
    # The lineage of trained prompts (flat indices, one per draw): none trained twice across the kill.
    lineage: dict[int, dict[str, int]] = {}
    for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "begin" in rec:
            lineage = {k: v for k, v in lineage.items() if k <= rec["begin"]}
        else:
            lineage[rec["step"]] = rec["samples"]
    assert sorted(lineage) == list(range(1, CONFIG["max_steps"] + 1))
    totals: dict[str, int] = {}
    for per_prompt in lineage.values():
        for flat, count in per_prompt.items():
            totals[flat] = totals.get(flat, 0) + count
    assert all(c <= 4 for c in totals.values()), totals  # num_generations = 4: a draw is trained at most once

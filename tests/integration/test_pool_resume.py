"""Prompt pools across a SIGKILL and a resume (issue 36): the killed and resumed run's pools and prompt order equal,
step by step, those of an uninterrupted run of the same seed; nothing is lost or trained twice.

Both runs are real trainers in their own processes (``fault_scripts/run_trainer.py``, the fault harness) against
one real ``asyncgrpo serve`` (one after the other: a server takes one trainer's weights). The regime where equality
holds (``docs/usage.md``, prompt pools): a reward that depends on the prompt alone, so a prompt's results repeat,
and ``prompt_pool_lag=0``, one group in flight, so the trainer pulls groups in draw order and each step settles
the same draws in both runs (given samples of the same lengths: the random-init model's completions almost always
run to ``max_completion_length``; an early end-of-text in one run could move a group to another step). Every step checkpoints; the killed attempt dies once checkpoint-2 is complete and the
second attempt resumes (``resume: auto``) and runs to ``max_steps``.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from asyncgrpo.server.launcher import ServerProcess
from tests.helpers.fault_runs import start_run, wait_for
from tests.helpers.pool_states import check_pools_state

pytestmark = [pytest.mark.slow, pytest.mark.long]  # the long lane: `make test-long`

STEPS = 6
# New prompts weighted first, so the six steps spread over the rows: some retire, some park, the rest are rated.
CONFIG = {"max_steps": STEPS, "save_strategy": "steps", "save_steps": 1, "max_staleness": 16, "prompt_pools": True,
          "pass_threshold": 0.5, "prompt_pool_min_groups": 1, "prompt_pool_requeue_delay": 3,
          "prompt_pool_lag": 0, "prompt_pool_weights": [3.0, 1.0, 1.0, 1.0]}  # fmt: skip


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


def _lineage(where: Path) -> dict[int, dict]:
    """Each step's record (trained samples per flat index, settled draws) as the run that kept it wrote it: the
    lines of an attempt past the step the next attempt resumed from are dropped (that attempt trained them again)."""
    kept: dict[int, dict] = {}
    for line in (where / "steps.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "begin" in rec:
            kept = {step: r for step, r in kept.items() if step <= rec["begin"]}
        else:
            kept[rec["step"]] = rec
    return kept


def test_pools_after_a_sigkill_and_resume_equal_an_uninterrupted_run(tmp_path, server, tiny_llama_dir):
    def run(name: str):
        settings = {"dataset_size": 16, "resume": "auto", "reward": "row", "config": CONFIG,
                    "output_dir": str(tmp_path / name / "out")}  # fmt: skip
        return start_run(tmp_path, server.base_url, tiny_llama_dir, name=name, **settings)

    straight = run("straight")
    try:
        assert straight.wait(timeout=600) == 0, (tmp_path / "straight" / "log.txt").read_text()[-3000:]
    finally:
        if straight.poll() is None:
            straight.kill()
    out = tmp_path / "killed" / "out"
    killed = run("killed")
    try:
        wait_for(lambda: killed.poll() is not None or any(s >= 2 for s in _states(out)), 300, "checkpoint-2")
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        assert killed.returncode == -signal.SIGKILL, (tmp_path / "killed" / "log.txt").read_text()[-3000:]
        before = _states(out)
        killed = run("killed")
        assert killed.wait(timeout=600) == 0, (tmp_path / "killed" / "log.txt").read_text()[-3000:]
    finally:
        if killed.poll() is None:
            killed.kill()
    a, b = _states(tmp_path / "straight" / "out"), _states(out)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    resumed_at = max(before)
    assert b[resumed_at] == before[resumed_at]  # the resumed run read that checkpoint, never rewrote it
    for step in range(1, STEPS + 1):
        for state in (a[step], b[step]):
            check_pools_state(state)
        # The pools (rates, groups, parked clocks, retired, the held results, the seed) and where the prompt order
        # stands (first unsettled draw, outcomes past it) are the same at every step.
        assert a[step]["pools"] == b[step]["pools"], step
        assert (a[step]["first_untrained_prompt"], a[step]["settled"]) == (
            b[step]["first_untrained_prompt"],
            b[step]["settled"],
        ), step
    # The prompt order: each step settled the same draws (flat index, dataset row, pass fraction), in one order.
    la, lb = _lineage(tmp_path / "straight"), _lineage(tmp_path / "killed")
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    assert [la[s]["settled"] for s in la] == [lb[s]["settled"] for s in la]
    assert [la[s]["samples"] for s in la] == [lb[s]["samples"] for s in la]
    # Nothing lost or repeated: every draw settled once, the draws before the last checkpoint's first unsettled
    # one all settled, each trained draw's 4 samples trained once.
    draws = [d for s in sorted(lb) for d, _, _ in lb[s]["settled"]]
    assert len(draws) == len(set(draws)), draws
    assert set(range(b[STEPS]["first_untrained_prompt"])) <= set(draws)
    totals: dict[str, int] = {}
    for s in lb:
        for flat, count in lb[s]["samples"].items():
            totals[flat] = totals.get(flat, 0) + count
    assert totals and all(c == 4 for c in totals.values()), totals

"""A run against a server that an earlier run trained (issue 30, item 1).

Re-running a script against a running ``asyncgrpo serve`` is the README's workflow (docs/usage.md). The second run
must sample from its own weights from the first step: its step-1 gap between sampler and trainer log-probs must be a
fresh server's (fp32 on both sides: ~1e-5), not the gap to the first run's trained weights. Before the fix the
trainer pushed weights at start only when resuming, and this gap was the first run's learning step (0.70 here). A
server started on another checkpoint is the same case (the push is unconditional); its warning line is checked in
tests/unit/trainer/test_served_weights.py.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from pathlib import Path

import pytest

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.report import load_run
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset

pytestmark = [pytest.mark.slow, pytest.mark.long]  # about a minute on 2 cores: `make test-long`

FRESH_GAP_TOL = 1e-4  # fp32 sampler vs fp32 trainer on the same weights (a fresh server measures ~1e-5)


def parity_reward(completion_ids, **kwargs):
    """Varies within a group for a random model, so every group trains."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _run(model: str, out: Path, url: str, max_steps: int, **overrides) -> dict:
    """Train ``max_steps`` steps and return the first logged window (step 1)."""
    settings = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=str(out), max_steps=max_steps, num_generations=4, max_completion_length=12, token_budget=384,
        vllm_server_base_url=url, report_to=[], save_strategy="no", learning_rate=1e-3,
        gradient_checkpointing=False, vllm_server_timeout=120, rollout_worker_timeout=60, seed=0,
    )  # fmt: skip
    args = AsyncGRPOConfig(**{**settings, **overrides})
    dataset = reasoning_gym_dataset("chain_sum", size=16, seed=0, system_prompt=None)
    AsyncGRPOTrainer(model, reward_funcs=[parity_reward], args=args, train_dataset=dataset).train()
    return json.loads((out / "metrics.jsonl").read_text().splitlines()[0])


def test_second_run_on_one_server_samples_its_own_weights(tmp_path, serve, tiny_llama_dir, caplog, capsys):
    server = serve(tiny_llama_dir, "--max-model-len", "256", "--kv-cache-tokens", "16384")
    first = _run(str(tiny_llama_dir), tmp_path / "first", server.base_url, max_steps=2, compact_log=True)
    fresh_gap = first["sampling/sampling_logp_difference/max"]  # a fresh server's
    assert first["step"] == 1 and fresh_gap <= FRESH_GAP_TOL

    # The same run told what it did (issue 30, item 7): one compact line per step, every metric in metrics.jsonl;
    # and it left its settings where `asyncgrpo report` reads them (a Python API run as well as a YAML one).
    printed = capsys.readouterr().out
    assert re.search(r"^step +1/2 +reward \S+ +kept", printed, re.MULTILINE), printed
    assert "'sampling/sampling_logp_difference/max'" not in printed  # not transformers' whole dict
    assert len(first) > 40
    assert load_run(tmp_path / "first").settings.num_generations == 4  # from run_config.json (the default is 8)

    # The same script again: the server now holds the first run's step-2 weights (lr 1e-3 moved them).
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.served_weights"):
        second = _run(str(tiny_llama_dir), tmp_path / "second", server.base_url, max_steps=1, save_strategy="steps")
    gap = second["sampling/sampling_logp_difference/max"]
    assert second["step"] == 1 and second["sample/staleness_max"] == 0
    assert gap <= FRESH_GAP_TOL and abs(gap - fresh_gap) <= FRESH_GAP_TOL, (gap, fresh_gap)
    warned = [r.getMessage() for r in caplog.records]
    assert any("'step-2'" in m and server.base_url in m for m in warned), warned

    # The second run kept transformers' default save_strategy="steps" (save_steps=500): train() left the final model
    # in output_dir, readable as the umask allows, and no off-grid checkpoint-1 with a second copy of it (item 9).
    out = tmp_path / "second"
    assert not list(out.glob("checkpoint-*"))
    umask = os.umask(0)
    os.umask(umask)
    for name in ("model.safetensors", "config.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o666 & ~umask, name

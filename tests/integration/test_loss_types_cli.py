"""``asyncgrpo train`` with each ``loss_type``: bad choices exit 2 in seconds; every family trains and logs metrics.

The refusals run in the default lane (no model is loaded). The end-to-end runs (tiny model, embedded CPU server,
2 steps each) are in the long lane: `make test-long`.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.integration.test_cli import ROOT, asyncgrpo, timed

pytestmark = pytest.mark.slow


def _demo_yaml(tmp_path, **args) -> str:
    cfg = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    cfg["args"].update(args)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize(
    "args,message",
    [
        ({"loss_type": "ppo"}, "loss_type='ppo': must be one of asyncgrpo, grpo, bnpo, dr_grpo, dapo, cispo"),
        ({"vllm_importance_sampling_mode": "sequence_mask"}, "choose a TRL loss_type such as 'dapo'"),
    ],
)
def test_bad_loss_choice_exits_2_fast(tmp_path, args, message):
    out, seconds = timed("train", "--config", _demo_yaml(tmp_path, **args), timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and message in out.stderr, out.stderr
    assert seconds < 15, f"took {seconds:.1f} s of CPU"


FAMILIES = {
    "grpo": {"loss_type": "grpo"},
    "bnpo": {"loss_type": "bnpo", "vllm_importance_sampling_mode": "token_truncate"},
    "dr_grpo": {"loss_type": "dr_grpo", "vllm_importance_sampling_mode": "sequence_mask"},
    "dapo": {"loss_type": "dapo", "vllm_importance_sampling_mode": "icepop"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4,
             "vllm_importance_sampling_correction": False},
    "cispo": {"loss_type": "cispo", "vllm_importance_sampling_mode": "sequence_truncate"},
}  # fmt: skip


@pytest.mark.long
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_loss_type_trains_and_logs_its_metrics(tmp_path, tiny_llama_dir, name):
    cfg = {
        "model": str(tiny_llama_dir),
        "dataset": {"recipe": "reasoning_gym", "task": "chain_sum", "size": 16, "seed": 0, "system_prompt": None},
        "reward_funcs": ["tests.helpers.rewards:even_token_reward"],
        "server": {"embedded": True, "device": "cpu", "args": ["--max-model-len", "256", "--kv-cache-tokens", "16384"]},
        "args": {"output_dir": str(tmp_path / "out"), "max_steps": 2, "num_generations": 4,
                 "max_completion_length": 12, "token_budget": 384, "learning_rate": 1e-3,
                 "gradient_checkpointing": False, "save_strategy": "no", "report_to": [], "seed": 0,
                 "vllm_server_timeout": 120, "rollout_worker_timeout": 60, **FAMILIES[name]},
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = asyncgrpo("train", "--config", str(path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "policy_ratio/mean" in r]
    assert len(steps) == 2, rows
    for r in steps:
        assert r["loss"] == r["loss"] and r["grad_norm"] > 0  # finite loss, a gradient reached the weights
        for key in ("sampling/masked_mean", "sampling/truncated_mean", "clip_ratio/region_mean", "policy_ratio/max"):
            assert 0 <= r[key] < float("inf"), key
    if FAMILIES[name].get("vllm_importance_sampling_mode", "").startswith("sequence"):
        assert all("sampling/sequence_ratio/mean" in r for r in steps)

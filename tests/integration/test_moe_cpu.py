"""A short MoE run end to end on CPU (SPEC L6): tiny Qwen3-MoE, ``asyncgrpo serve`` (its general HF path), fp32.

The first step trains samples of the weights the server started with, so the trainer's packed log-probs must
reproduce the sampler's; the router load-balancing loss is added and logged as ``aux_loss``; the server ends on
the step's weights.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset

pytestmark = [pytest.mark.slow, pytest.mark.long]  # about a minute on 2 cores: `make test-long`


def parity_reward(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def test_moe_run_matches_the_sampler_logs_aux_loss_and_syncs(tmp_path, serve):
    model_dir = tiny_model_dir("qwen3_moe")
    server = serve(model_dir, "--max-model-len", "256", "--kv-cache-tokens", "8192")
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=1, num_generations=4, max_completion_length=6, token_budget=192,
        vllm_server_base_url=server.base_url, report_to=[], save_strategy="no", learning_rate=1e-3,
        gradient_checkpointing=False, vllm_server_timeout=120, rollout_worker_timeout=60, seed=0,
        router_aux_loss_coef=0.01,
    )  # fmt: skip
    dataset = reasoning_gym_dataset("chain_sum", size=8, seed=0, system_prompt=None)
    trainer = AsyncGRPOTrainer(str(model_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset)
    assert trainer.router_aux_coef == 0.01
    assert trainer.train().global_step == 1
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "sampling/sampling_logp_difference/max" in r]
    assert trained[0]["sample/staleness_max"] == 0
    assert trained[0]["sampling/sampling_logp_difference/max"] <= 1e-3
    aux = [r["aux_loss"] for r in rows if "aux_loss" in r]
    # E * sum_e f_e P_e with sum f = top-k = 2 and sum P = 1: in (0, 4]; a balanced router gives 2
    assert len(aux) == 1 and all(math.isfinite(a) and 0.0 < a <= 4.0 for a in aux)

    async def version():
        async with AsyncServerClient(server.base_url) as client:
            return (await client.weight_info())["weight_version"]

    assert asyncio.run(version()) == "step-1"  # the weight version advanced with the sync after step 1

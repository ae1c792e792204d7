"""MoE routing replay under FSDP2 on two processes (gloo, CPU), against the same trainer on one process.

The server (bf16, ``--enable-return-routed-experts``) samples a tiny OLMoE-shaped model; the two-process run
shards it with FSDP2 and recomputes every decoder layer in backward (gradient checkpointing), so the routing must
stay set through backward. Reference: the one-process trainer, checkpointing off, fed the rows both processes
trained at step 1 (routing included): the gathered FSDP2 gradient must equal its gradient, router weights
included. Also checked: the step-1 rows carry the server's routing, and the metrics file logs
``moe/routing_mismatch`` 0 with the router disagreement it replaced.
"""

from __future__ import annotations

import json

import pytest
import torch

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
from asyncgrpo.trainer.loss import loss_normalizer
from tests.helpers.fsdp_launch import launch_ranks
from tests.helpers.moe_models import sharp_moe_dir
from tests.helpers.rewards import even_token_reward

pytestmark = [pytest.mark.slow, pytest.mark.long]  # the long lane: `make test-long`

FSDP = {
    "fsdp": "full_shard",
    "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["OlmoeDecoderLayer"]},
}


def _config(out, **overrides) -> dict:
    base = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=str(out), max_steps=1, num_generations=4, max_completion_length=12, token_budget=256,
        report_to=[], save_strategy="no", learning_rate=1e-3, optim="adamw_torch", max_grad_norm=0.0,
        gradient_checkpointing=True, vllm_server_timeout=120, rollout_worker_timeout=60, seed=0, use_cpu=True,
        logging_steps=1, gradient_accumulation_steps=2, router_replay=True,
        # the load-balancing term is averaged over processes by design (trainer/moe.py), which this one-process
        # reference (both processes' rows summed) does not reproduce; replay is what is compared here
        router_aux_loss_coef=0.0,
    )  # fmt: skip
    base.update(overrides)
    return base


def test_fsdp2_replay_matches_one_process(tmp_path, serve):
    model_dir = sharp_moe_dir("olmoe", tmp_path / "model")
    server = serve(model_dir, "--max-model-len", "256", "--kv-cache-tokens", "16384", "--dtype", "bfloat16",
                   "--enable-return-routed-experts")  # fmt: skip
    out = tmp_path / "out"
    spec = {"model_dir": str(model_dir), "base_url": server.base_url, "dump_dir": str(tmp_path / "run"),
            "config": {**_config(out), **FSDP}}  # fmt: skip
    result = launch_ranks(spec, 2, tmp_path / "run")
    assert result["global_step"] == 1 and result["sharded"]
    step1 = torch.load(tmp_path / "run" / "step1.pt", weights_only=False)
    rows = step1["rows"]
    assert all(row.routed_experts is not None and (row.routed_experts >= 0).any() for micro in rows for row in micro)

    args = AsyncGRPOConfig(vllm_server_base_url=server.base_url,
                           **_config(tmp_path / "reference", gradient_checkpointing=False))  # fmt: skip
    dataset = reasoning_gym_dataset("chain_sum", size=24, seed=0, system_prompt=None)
    trainer = AsyncGRPOTrainer(str(model_dir), reward_funcs=[even_token_reward], args=args, train_dataset=dataset)
    model = trainer.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(step1["params"][name])  # the two-process run's starting point
    model.zero_grad()
    for micro in rows:
        norm = loss_normalizer(sum(r.num_trained for r in micro), args.gradient_accumulation_steps, 1)
        for row in micro:
            trainer.training_step(model, {"row": row, "normalizer": norm})
    want = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    got = step1["grads"]
    assert set(got) == set(want) and any("mlp.gate" in n for n in want)  # the routers train under replay
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-7, msg=name)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in metrics if "moe/routing_mismatch/max" in r]
    assert logged and all(r["moe/routing_mismatch/max"] == 0.0 for r in logged)

"""FSDP2 training on two processes (gloo, CPU) against a real server, checked against a one-process run (T7, L5).

The two-process run is the real trainer launched by ``torchrun`` with TRL-style FSDP2 settings
(``fsdp``/``fsdp_config``), two micro-batches per step, gradient checkpointing on and sharded checkpoints. The
reference is the same trainer in this one process, fed the rows both processes trained at step 1: its gradient must
equal the gathered FSDP2 gradient, which holds only if every rank trained its own row, the FSDP2 root forward
reached every parameter, and the loss was divided by the trained tokens of both rows (the global count).
The server then serves the gathered weights, and a sharded checkpoint resumes on two processes.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
from asyncgrpo.trainer.loss import loss_normalizer
from tests.helpers.fsdp_launch import launch_ranks
from tests.helpers.rewards import even_token_reward

pytestmark = [pytest.mark.slow, pytest.mark.long]  # the long lane: `make test-long`

FSDP = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT",
                                               "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}  # fmt: skip


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--max-model-len", "256", "--kv-cache-tokens", "16384")


def _config(out: Path, **overrides) -> dict:
    base = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=str(out), max_steps=2, num_generations=4, max_completion_length=12, token_budget=256,
        report_to=[], save_strategy="steps", save_steps=2, learning_rate=1e-3, optim="adamw_torch",
        max_grad_norm=0.0, gradient_checkpointing=True, vllm_server_timeout=120, rollout_worker_timeout=60,
        seed=0, use_cpu=True, logging_steps=1, gradient_accumulation_steps=2,
    )  # fmt: skip
    base.update(overrides)
    return base


def _one_process_grads(model_dir: Path, base_url: str, out: Path, rows: list, params: dict, **loss) -> dict:
    """The same trainer on one process: step 1's micro-batches, every process's row in turn, one backward each."""
    kwargs = _config(out / "reference", gradient_checkpointing=False, save_strategy="no", **loss)
    args = AsyncGRPOConfig(vllm_server_base_url=base_url, **kwargs)
    dataset = reasoning_gym_dataset("chain_sum", size=24, seed=0, system_prompt=None)
    trainer = AsyncGRPOTrainer(str(model_dir), reward_funcs=[even_token_reward], args=args, train_dataset=dataset)
    model = trainer.model
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])  # the two-process run's starting point
    model.zero_grad()
    step_tokens = sum(r.num_trained for micro in rows for r in micro)
    for micro in rows:
        norm = loss_normalizer(sum(r.num_trained for r in micro), args.gradient_accumulation_steps, 1)
        if args.loss_type == "grpo":  # GSPO's mean over the micro-batch's sequences, both processes' rows
            norm = sum(len(set(r.entry_sample.tolist())) for r in micro) * args.gradient_accumulation_steps
        elif args.loss_type == "dapo":  # the step's tokens over both processes and both micro-batches
            norm = step_tokens
        for row in micro:
            trainer.training_step(model, {"row": row, "normalizer": norm})
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _server_matches(model_dir: Path, base_url: str, params: dict) -> None:
    """The server's log-probs of its own sample equal a plain forward of ``params``: the gathered weights arrived."""
    from transformers import AutoModelForCausalLM

    async def sample():
        async with AsyncServerClient(base_url) as client:
            return await client.generate([1, 2, 3, 4, 5], {"max_tokens": 8, "temperature": 1.0, "seed": 3})

    res = asyncio.run(sample())
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model.load_state_dict(params)
    ids = torch.tensor([[1, 2, 3, 4, 5, *res.token_ids]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, 4:-1].double(), -1)
    expected = logp.gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(res.logprobs, dtype=torch.float64), expected, atol=1e-4)


def test_two_process_fsdp2_matches_one_process_and_resumes_sharded(tmp_path, server, tiny_llama_dir):
    out = tmp_path / "out"
    spec = {"model_dir": str(tiny_llama_dir), "base_url": server.base_url, "dump_dir": str(tmp_path / "run1"),
            "config": {**_config(out), **FSDP}}  # fmt: skip
    first = launch_ranks(spec, 2, tmp_path / "run1")
    assert first == {"global_step": 2, "world_size": 2, "sharded": True, "weight_version": "step-2"}

    step1 = torch.load(tmp_path / "run1" / "step1.pt", weights_only=False)
    rows = step1["rows"]
    assert len(rows) == 2 and all(len(micro) == 2 for micro in rows)  # 2 micro-batches x 2 processes
    assert all(row.num_trained > 0 for micro in rows for row in micro), "each process must train tokens of its own"
    want = _one_process_grads(tiny_llama_dir, server.base_url, tmp_path, rows, step1["params"])
    got = step1["grads"]
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)

    saved = torch.load(tmp_path / "run1" / "end.pt", weights_only=False)
    _server_matches(tiny_llama_dir, server.base_url, saved["params"])  # step 2's sync sent the sharded weights whole

    # The sharded checkpoint of step 2 resumes on two processes: weights and Adam moments as they were saved.
    ckpt = out / "checkpoint-2"
    assert (ckpt / "rollout_state.json").is_file()
    assert any(p.name.startswith("pytorch_model_fsdp") for p in ckpt.iterdir())  # sharded (DCP) model state
    spec2 = {**spec, "dump_dir": str(tmp_path / "run2"), "resume": True,
             "config": {**spec["config"], "max_steps": 3, "save_strategy": "no"}}  # fmt: skip
    second = launch_ranks(spec2, 2, tmp_path / "run2")
    assert second == {"global_step": 3, "world_size": 2, "sharded": True, "weight_version": "step-3"}
    resumed = torch.load(tmp_path / "run2" / "begin.pt", weights_only=False)
    for kind in ("params", "exp_avg"):
        assert saved[kind] and set(saved[kind]) == set(resumed[kind]), kind
        for name, value in saved[kind].items():
            assert torch.equal(resumed[kind][name], value), (kind, name)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3]  # step 3 once, after the resume


@pytest.mark.parametrize(
    "loss",
    [
        {
            "loss_type": "grpo",
            "importance_sampling_level": "sequence",
            "vllm_importance_sampling_mode": "sequence_truncate",
        },
        {"loss_type": "dapo", "vllm_importance_sampling_mode": "token_truncate"},
    ],
)
def test_two_process_fsdp2_loss_families_use_global_normalizers(tmp_path, server, tiny_llama_dir, loss):
    """GSPO divides by the sequences, DAPO by the step's tokens, of every process: the FSDP2 gradient of step 1
    equals one process training both processes' rows with those counts written out here."""
    out = tmp_path / "out"
    cfg = {**_config(out, max_steps=1, save_strategy="no", **loss), **FSDP}
    spec = {"model_dir": str(tiny_llama_dir), "base_url": server.base_url, "dump_dir": str(tmp_path / "run"),
            "config": cfg}  # fmt: skip
    assert launch_ranks(spec, 2, tmp_path / "run")["global_step"] == 1
    step1 = torch.load(tmp_path / "run" / "step1.pt", weights_only=False)
    rows = step1["rows"]
    assert all(row.num_trained > 0 for micro in rows for row in micro)
    want = _one_process_grads(tiny_llama_dir, server.base_url, tmp_path, rows, step1["params"], **loss)
    got = step1["grads"]
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-7, msg=name)

"""End to end on CPU with a Gated DeltaNet hybrid (SPEC P6): real server (general HF path), worker and trainer.

The tiny Qwen3.5-style model (three DeltaNet layers, one attention layer, SmolLM2 tokenizer) samples on
``asyncgrpo serve`` and trains on packed trie rows. In step 1 both sides hold the starting weights in
fp32, so the trainer's packed log-probs must reproduce the sampler's (measured: 1.9e-6 under transformers
5.17 and 5.25): a sibling completion leaking into the DeltaNet convolution or state shows here as ~1e-2 (4.2e-2
when transformers 5.25's ``kernelize`` at ``model.train()`` dropped the trie-aware forward).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset

pytestmark = pytest.mark.slow


def parity_reward(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@pytest.fixture(scope="module")
def deltanet_dir():
    return tiny_model_dir("qwen3_5")


@pytest.fixture(scope="module")
def server(serve, deltanet_dir):
    # one thread per process: small batched triangular solves crawl when 2 threads fight over 2 busy cores
    return serve(deltanet_dir, "--max-model-len", "192", "--max-num-seqs", "8", env={"OMP_NUM_THREADS": "1"})


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_deltanet_hybrid_trains_with_exact_packed_logprobs(tmp_path, server, deltanet_dir, one_thread):
    # the config's defaults otherwise, gradient checkpointing included (the DeltaNet layers are recomputed)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        num_generations=4,
        max_completion_length=10,
        token_budget=320,
        vllm_server_base_url=server.base_url,
        report_to=[],
        save_strategy="no",
        learning_rate=1e-3,
        vllm_server_timeout=120,
        rollout_worker_timeout=60,
        seed=0,
    )
    dataset = reasoning_gym_dataset("chain_sum", size=4, seed=0, system_prompt=None)
    trainer = AsyncGRPOTrainer(str(deltanet_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset)
    assert type(trainer.model).__name__ == "Qwen3_5ForCausalLM"
    assert trainer.model._asyncgrpo_linear_layers == 3  # the trie-aware DeltaNet layers are installed
    out = trainer.train()
    assert out.global_step == 1
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]
    assert first["step"] == 1 and first["sample/staleness_max"] == 0
    assert first["batch/packing_ratio"] > 1.2  # the group's prompt is shared: completions fork in the trie
    assert first["sampling/sampling_logp_difference/max"] <= 1e-4

    async def version() -> str:
        async with AsyncServerClient(server.base_url) as client:
            return (await client.weight_info())["weight_version"]

    assert asyncio.run(version()) == "step-1"  # the server took the trained weights

"""End to end on CPU with a vision-language checkpoint trained on text (T4): a real ``asyncgrpo serve`` process on
the tiny Qwen3-VL (general model path), the real rollout worker and the trainer (image-text class, frozen tower).

Step 1 trains samples of the weights both sides loaded, in fp32: the trainer's packed log-probs on the text model
must reproduce the server's (``sampling/sampling_logp_difference`` <= 1e-3). The syncs carry text weights only; the
weight version advances and the server then generates like the trainer's model.
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

pytestmark = [pytest.mark.slow, pytest.mark.long]  # the long lane: `make test-long`


def parity_reward(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def test_vlm_text_only_run_matches_the_sampler_and_syncs(tmp_path, serve):
    model_dir = tiny_model_dir("qwen3_vl")
    server = serve(model_dir, "--max-model-len", "256", "--kv-cache-tokens", "8192")
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=2, num_generations=4, max_completion_length=8,
        token_budget=384, vllm_server_base_url=server.base_url, report_to=[], save_strategy="no",
        learning_rate=1e-3, gradient_checkpointing=False, vllm_server_timeout=120, rollout_worker_timeout=60, seed=0,
    )  # fmt: skip
    dataset = reasoning_gym_dataset("chain_sum", size=8, seed=0, system_prompt=None)
    trainer = AsyncGRPOTrainer(str(model_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset)
    assert type(trainer.model).__name__ == "Qwen3VLForConditionalGeneration"
    assert trainer.train().global_step == 2

    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 1 and rows[0]["sample/staleness_max"] == 0
    assert rows[0]["sampling/sampling_logp_difference/max"] <= 1e-3

    async def sample():
        async with AsyncServerClient(server.base_url) as client:
            info = await client.weight_info()
            res = await client.generate([1, 2, 3, 4, 5], {"max_tokens": 8, "temperature": 1.0, "seed": 3})
            return info, res

    info, res = asyncio.run(sample())
    assert info["weight_version"] == "step-2"
    model = trainer.model.float().eval()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([[1, 2, 3, 4, 5, *res.token_ids]])).logits[0, 4:-1].double(), -1)
    expected = logp.gather(-1, torch.tensor(res.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(res.logprobs, dtype=torch.float64), expected, atol=1e-4)

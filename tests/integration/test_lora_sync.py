"""Adapter sync end to end (SPEC T6): a PEFT run against ``asyncgrpo serve --enable-lora`` (tiny Llama, fp32, CPU).

After every sync the server, asked for the newest adapter by name, decodes greedily exactly what the trainer's
PEFT model does (log-probs within 1e-4); versions that left the staleness window are unloaded and their
directories under ``<output_dir>/.vllm_lora`` removed; ``save_strategy="no"`` warns; the start-up checks name the
server flag to raise. The run uses ``max_staleness=0`` so that every trained sample comes from the adapter of the
trainer's current weights: the sampler/trainer log-prob gap of every step shows the requests named that adapter.
The server's ``--max-loras 2`` is exactly ``max_staleness + 2``: a version not retired would make the next load fail.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
from tests.helpers.reference import PROMPT, check_greedy

pytestmark = pytest.mark.slow

GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 3}
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "lora_dropout": 0.0}


def parity_reward(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def _server_state(base_url: str, adapter: str | None):
    async def go():
        async with AsyncServerClient(base_url, retries=0) as c:
            ids = [m["id"] for m in await c.models()]
            lora = await c.generate(PROMPT, GREEDY, model=adapter) if adapter else None
            base = await c.generate(PROMPT, GREEDY)
            return ids, lora, base

    return asyncio.run(go())


class SyncChecker(TrainerCallback):
    """Before each step (and at the end): the newest adapter on the server must be the trainer's model."""

    def __init__(self, base_url: str, lora_dir: Path) -> None:
        self.base_url, self.lora_dir = base_url, lora_dir
        self.seen: list[dict] = []
        self.model = None

    def _check(self, step: int) -> None:
        name = f"asyncgrpo-lora-step-{step}"
        ids, lora, base = _server_state(self.base_url, name)
        model = self.model
        model.eval()
        with torch.no_grad():
            check_greedy(model, lora)  # tokens equal, log-probs and top-3 within 1e-4
        model.train()
        dirs = sorted(p.name for p in self.lora_dir.iterdir() if p.is_dir())
        gap = max(abs(a - b) for a, b in zip(lora.logprobs, base.logprobs))
        self.seen.append({"step": step, "adapters": sorted(i for i in ids if "-step-" in i), "dirs": dirs, "gap": gap})

    def on_step_begin(self, args, state, control, **kwargs):
        self._check(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._check(state.global_step)


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(
        tiny_llama_dir, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
        "--max-model-len", "256", "--kv-cache-tokens", "16384",
    )  # fmt: skip


def _config(tmp_path: Path, server, **overrides) -> AsyncGRPOConfig:
    base = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=str(tmp_path / "out"), max_steps=3, max_staleness=0, num_generations=4, max_completion_length=10,
        token_budget=384, vllm_server_base_url=server.base_url, report_to=[], save_strategy="no",
        learning_rate=3e-2, gradient_checkpointing=False, vllm_server_timeout=120, rollout_worker_timeout=60, seed=0,
    )  # fmt: skip
    base.update(overrides)
    return AsyncGRPOConfig(**base)


def test_adapter_sync_serves_the_trainers_adapter_and_retires_old_versions(tmp_path, server, tiny_llama_dir, caplog):
    dataset = reasoning_gym_dataset("chain_sum", size=16, seed=0, system_prompt=None)
    out = tmp_path / "out"
    checker = SyncChecker(server.base_url, out / ".vllm_lora")
    trainer = AsyncGRPOTrainer(
        str(tiny_llama_dir), reward_funcs=[parity_reward], args=_config(tmp_path, server), train_dataset=dataset,
        peft_config=LoraConfig(**LORA), callbacks=[checker],
    )  # fmt: skip
    checker.model = trainer.model
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.weights.lora_sync"):
        trainer.train()
    assert any("nothing of the trained adapter will be left" in r.getMessage() for r in caplog.records)
    names = [f"asyncgrpo-lora-step-{i}" for i in range(4)]
    # max_staleness=0: one version live; the previous one goes once the next is loaded (load before release).
    assert [s["step"] for s in checker.seen] == [0, 1, 2, 3]
    assert [s["adapters"] for s in checker.seen] == [[n] for n in names]
    assert [s["dirs"] for s in checker.seen] == [[n] for n in names]
    assert checker.seen[0]["gap"] < 1e-4  # a fresh LoRA (B = 0) is the base model
    assert checker.seen[-1]["gap"] > 1e-3  # the trained adapter moved the policy: the comparison is not vacuous
    cfg = json.loads((out / ".vllm_lora" / names[3] / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "sampling/sampling_logp_difference/max" in r]
    assert len(trained) == 3 and all(r["sample/staleness_max"] == 0 for r in trained)
    # Steps 2 and 3 train samples of adapters step-1 and step-2, which differ from the base model (gap above).
    assert all(r["sampling/sampling_logp_difference/max"] < 1e-3 for r in trained)
    assert any("perf/weight_sync_s" in r for r in rows)


def test_start_up_checks_name_the_server_flags(tmp_path, server, tiny_llama_dir):
    dataset = reasoning_gym_dataset("chain_sum", size=4, seed=0, system_prompt=None)
    args = _config(tmp_path, server, max_staleness=1)
    lora = LoraConfig(**{**LORA, "r": 9})
    trainer = AsyncGRPOTrainer(
        str(tiny_llama_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset, peft_config=lora
    )
    with pytest.raises(ValueError) as info:
        trainer.train()
    msg = str(info.value)
    assert "--max-lora-rank 16" in msg and "--max-loras 3" in msg


def test_a_rollout_names_its_groups_adapter_and_falls_back_once_it_is_retired(tmp_path, server, tiny_llama_dir):
    """A group started under version 2 asks for adapter t-step-2; once that left the window (404) its rollouts
    continue on the current version's adapter (their samples are too stale to train anyway)."""
    import multiprocessing as mp

    from asyncgrpo import AsyncRolloutLoop
    from asyncgrpo.assets import smollm2_tokenizer
    from asyncgrpo.client.pool import ServerPool
    from asyncgrpo.rollout.requests import GroupRoute, Requester, current_route, enter_group
    from asyncgrpo.rollout.sampling import SamplingSettings
    from asyncgrpo.rollout.settings import RolloutSettings
    from asyncgrpo.weights.lora_sync import adapter_state, write_adapter
    from tests.helpers.reference import hf_model, lora_model

    peft_model = lora_model(hf_model(tiny_llama_dir), seed=5, rank=4)
    write_adapter(peft_model, adapter_state(peft_model), tmp_path / "t-step-3")
    settings = RolloutSettings(
        model_name="base", sampling=SamplingSettings(server.base_url, 256, 6), num_generations=2, max_staleness=0,
        seed=0, max_concurrent_rollouts=2, initial_tokens_per_step=64, lora_name="t",
    )  # fmt: skip
    loop = AsyncRolloutLoop(settings, [], [], smollm2_tokenizer())
    policy_version = mp.get_context("spawn").Value("q", 3)

    async def go():
        pool = ServerPool([server.base_url], timeout=60, max_connections=2)
        loop.requester = Requester(settings, pool, lambda: policy_version.value)  # what run() wires
        client = pool.client(0)
        await client.load_lora_adapter("t-step-3", str(tmp_path / "t-step-3"))
        try:
            outside = loop.request_model()  # no group: the current version
            enter_group(GroupRoute(server=0, version=2))
            asked = loop.request_model()
            (got,) = await loop.requester._request(PROMPT, GREEDY, asked, current_route())  # one result: n = 1
            direct = await client.generate(PROMPT, GREEDY, model="t-step-3")
        finally:
            await client.unload_lora_adapter("t-step-3")
            await pool.close()
        return outside, asked, got, direct

    outside, asked, got, direct = asyncio.run(go())
    assert (outside, asked) == ("t-step-3", "t-step-2")
    assert got.token_ids == direct.token_ids and got.logprobs == direct.logprobs
    model = peft_model.eval()
    check_greedy(model, got)  # and it is the adapter's output, not the base model's


@pytest.mark.long  # a scenario of half a minute on 2 cores: `make test-long`
def test_adapter_sync_needs_no_weight_transfer(tmp_path, serve, tiny_llama_dir):
    """A server with --enable-lora and no weight transfer: adapter sync only writes files and calls
    /v1/load_lora_adapter, so the run trains (it stopped at start before issue 26: "has no weight transfer")."""
    server = serve(tiny_llama_dir, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-model-len",
                   "256", "--weight-transfer-config", '{"backend": "none"}')  # fmt: skip
    dataset = reasoning_gym_dataset("chain_sum", size=4, seed=0, system_prompt=None)
    trainer = AsyncGRPOTrainer(
        str(tiny_llama_dir), reward_funcs=[parity_reward], args=_config(tmp_path, server, max_steps=1),
        train_dataset=dataset, peft_config=LoraConfig(**LORA),
    )  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.served_adapter == "asyncgrpo-lora-step-1"

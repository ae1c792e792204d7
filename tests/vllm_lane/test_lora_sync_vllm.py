"""LoRA adapter sync against a real vLLM over several steps (SPEC T6, issue 26).

Before every step and at the end, the server, asked for the newest adapter by name, decodes greedily what the
trainer's PEFT model decodes, with log-probs within fp32 noise; ``max_staleness + 1`` versions stay registered.
Adapter sync does not use the server's weight transfer (``test_tools_vllm.py`` runs against a server without it).
"""

from __future__ import annotations

import pytest
from peft import LoraConfig
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
from tests.vllm_lane.runs import (
    FP32_NOISE,
    LORA,
    lane_config,
    logprob_gap,
    metric_rows,
    parity_reward,
    server_adapters,
    server_complete,
)

pytestmark = pytest.mark.slow


class AdapterParity(TrainerCallback):
    """Before each step (the previous step's sync is done) and at the end: the server's newest adapter is the
    trainer's model."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.trainer: AsyncGRPOTrainer | None = None
        self.seen: list[dict] = []

    def _check(self, step: int) -> None:
        assert self.trainer is not None
        name = f"asyncgrpo-lora-step-{step}"
        lora = server_complete(self.base_url, name)
        base = server_complete(self.base_url, None)
        gap = logprob_gap(self.trainer.model, lora)
        moved = max(abs(a - b) for a, b in zip(lora.logprobs, base.logprobs))
        self.seen.append({"step": step, "gap": gap, "moved": moved, "adapters": server_adapters(self.base_url)})

    def on_step_begin(self, args, state, control, **kwargs):
        self._check(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._check(state.global_step)


def test_adapter_sync_over_several_steps_matches_the_trainers_model(tmp_path, real_vllm):
    dataset = reasoning_gym_dataset("chain_sum", size=32, seed=0, system_prompt=None)
    args = lane_config(tmp_path, real_vllm.base_url, max_steps=4, max_staleness=2)
    parity = AdapterParity(real_vllm.base_url)
    trainer = AsyncGRPOTrainer(str(real_vllm.model_dir), reward_funcs=[parity_reward], args=args,
                               train_dataset=dataset, peft_config=LoraConfig(**LORA), callbacks=[parity])  # fmt: skip
    parity.trainer = trainer
    trainer.train()

    assert [s["step"] for s in parity.seen] == [0, 1, 2, 3, 4]
    assert all(s["gap"] <= FP32_NOISE for s in parity.seen), parity.seen
    assert parity.seen[0]["moved"] < FP32_NOISE  # a fresh LoRA (B = 0) is the base model
    assert parity.seen[-1]["moved"] > 10 * FP32_NOISE, parity.seen  # training moved the policy: not vacuous
    # max_staleness + 1 = 3 versions stay registered; older ones are unloaded.
    assert parity.seen[-1]["adapters"] == [f"asyncgrpo-lora-step-{i}" for i in (2, 3, 4)]
    trained = [r for r in metric_rows(tmp_path / "out") if "sampling/sampling_logp_difference/max" in r]
    assert len(trained) == 4
    # Step 1 trains samples of version 0, the trainer's own weights: sampler and trainer log-probs agree to fp32
    # noise (later steps may train samples up to max_staleness versions old, which differ by design).
    diffs = [r["sampling/sampling_logp_difference/max"] for r in trained]
    assert diffs[0] < FP32_NOISE, diffs

"""Runs that meet a real vLLM in a bad state (issue 26): found paused at start, and a rejected sync round."""

from __future__ import annotations

import logging
import shutil

import pytest
from peft import LoraConfig
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
from tests.helpers.raw_http import raw
from tests.vllm_lane.runs import LORA, lane_config, parity_reward, server_complete

pytestmark = pytest.mark.slow


def _dataset():
    return reasoning_gym_dataset("chain_sum", size=16, seed=0, system_prompt=None)


def test_a_run_that_finds_the_server_paused_resumes_it_and_trains(tmp_path, real_vllm, caplog):
    """A keep pause left by a crashed run makes vLLM queue every request: before the fix the new run waited for
    its samples until the timeout. Now the start-up resumes the server, naming it."""
    url = real_vllm.base_url
    assert raw(url, "POST", "/pause", params={"mode": "keep"}) == (200, {"status": "paused"})
    args = lane_config(tmp_path, url, max_steps=1, vllm_server_timeout=120)
    trainer = AsyncGRPOTrainer(str(real_vllm.model_dir), reward_funcs=[parity_reward], args=args,
                               train_dataset=_dataset(), peft_config=LoraConfig(**LORA))  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.server_setup"):
            trainer.train()
    finally:
        raw(url, "POST", "/resume")  # never leave the lane's server paused for the next test
    assert trainer.state.global_step == 1
    assert any("is paused" in r.getMessage() and url in r.getMessage() for r in caplog.records)
    assert raw(url, "GET", "/is_paused") == (200, {"is_paused": False})


class TakeTheNextAdapterName(TrainerCallback):
    """At the end of step 1, before the trainer publishes version 1, someone else registers an adapter under the
    name the trainer is about to use: vLLM refuses the trainer's load (400, already loaded)."""

    def __init__(self, base_url: str, lora_dir) -> None:
        self.base_url, self.lora_dir = base_url, lora_dir

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 1:
            return
        squatter = self.lora_dir.parent / "squatter"
        shutil.copytree(self.lora_dir / "asyncgrpo-lora-step-0", squatter)
        body = {"lora_name": "asyncgrpo-lora-step-1", "lora_path": str(squatter.resolve())}
        status, answer = raw(self.base_url, "POST", "/v1/load_lora_adapter", json=body)
        assert status == 200, answer


def test_a_rejected_sync_round_stops_the_run_naming_the_server_and_leaves_it_serving(tmp_path, real_vllm):
    url = real_vllm.base_url
    args = lane_config(tmp_path, url, max_steps=3)
    squat = TakeTheNextAdapterName(url, tmp_path / "out" / ".vllm_lora")
    trainer = AsyncGRPOTrainer(str(real_vllm.model_dir), reward_funcs=[parity_reward], args=args,
                               train_dataset=_dataset(), peft_config=LoraConfig(**LORA), callbacks=[squat])  # fmt: skip
    try:
        with pytest.raises(RuntimeError) as info:
            trainer.train()
        message = str(info.value)
        assert url in message and "asyncgrpo-lora-step-1" in message, message
        assert raw(url, "GET", "/is_paused") == (200, {"is_paused": False})
        assert len(server_complete(url, None).token_ids) == 6  # the server still serves
    finally:
        raw(url, "POST", "/v1/unload_lora_adapter", json={"lora_name": "asyncgrpo-lora-step-1"})

"""Tools in a multi-turn run against a real vLLM (SPEC A1, A2, A5).

The run does not rely on a trained model's luck: first the test checks, through the server, that greedy decoding
of each prompt is the tool call the lane's model was warmed up on (``lane_model.py``). The run samples at a low
temperature, so its rollouts call the tool, get its result back as a tool message, and answer in a second turn.
"""

from __future__ import annotations

import json
import re

import pytest
from datasets import Dataset
from peft import LoraConfig

from asyncgrpo import AsyncGRPOTrainer
from asyncgrpo.rollout.agents.tool_loop import schemas_of
from tests.helpers.raw_http import raw
from tests.vllm_lane.lane_model import TOOL_PROMPTS, TOOLS, lane_tokenizer
from tests.vllm_lane.runs import LORA, lane_config, metric_rows, server_complete

pytestmark = pytest.mark.slow

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def done_reward(completions, **kwargs) -> list[float]:
    """1 for a last message "Done.", 0 otherwise: the warm-up's two endings give groups reward variance."""
    return [1.0 if c[-1]["content"].strip() == "Done." else 0.0 for c in completions]


def test_the_model_calls_the_tool_greedily_through_vllm(real_vllm):
    tok = lane_tokenizer()
    for prompt, (name, arguments, _) in TOOL_PROMPTS.items():
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], tools=schemas_of(TOOLS),
                                      add_generation_prompt=True, tokenize=True)  # fmt: skip
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        params = {"max_tokens": 40, "temperature": 0.0, "logprobs": 0}
        text = tok.decode(server_complete(real_vllm.base_url, None, ids, params).token_ids)
        match = TOOL_CALL.search(text)
        assert match, f"the lane's model did not write a tool call for {prompt!r} (warm-up too short?): {text!r}"
        assert json.loads(match.group(1)) == {"name": name, "arguments": arguments}


def test_a_multi_turn_tool_run_trains_against_vllm(tmp_path, real_vllm):
    """Also issue 26's "adapter sync needs no weight transfer": in the lane this runs after the restart test,
    which started the server again without --weight-transfer-config (before the fix the run stopped at start)."""
    status, info = raw(real_vllm.base_url, "GET", "/server_info", params={"config_format": "json"})
    assert status == 200
    assert bool(info["vllm_config"].get("weight_transfer_config")) is real_vllm.has_weight_transfer
    prompts = [[{"role": "user", "content": p}] for p in TOOL_PROMPTS] * 8
    dataset = Dataset.from_dict({"prompt": prompts})
    args = lane_config(tmp_path, real_vllm.base_url, max_steps=2, temperature=0.5, max_completion_length=40,
                       max_tool_calling_iterations=2, token_budget=640, learning_rate=1e-5)  # fmt: skip
    trainer = AsyncGRPOTrainer(str(real_vllm.model_dir), reward_funcs=[done_reward], args=args, train_dataset=dataset,
                               processing_class=lane_tokenizer(), tools=TOOLS, peft_config=LoraConfig(**LORA))  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2
    rows = [r for r in metric_rows(tmp_path / "out") if "tools/call_frequency" in r]
    assert rows, "no step logged tool metrics"
    assert all(r["tools/call_frequency"] >= 0.9 for r in rows), rows  # (nearly) every rollout called a tool
    assert all(r["tools/failure_frequency"] == 0 for r in rows), rows
    assert all(r["rollout/turns_mean"] >= 1.9 for r in rows), rows  # a call, its result, then the answer

"""AsyncGRPOTrainer refuses bad input at construction, with messages that say what to change."""

import pytest

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.recipes import smollm2_tokenizer, tiny_model

ROWS = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}]


def reward(completions, **kwargs):
    return [0.0] * len(completions)


def _make(tmp_path, **kw):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[])
    base = {"model": tiny_model("llama"), "reward_funcs": [reward], "args": args, "train_dataset": ROWS,
            "processing_class": smollm2_tokenizer()}  # fmt: skip
    base.update(kw)
    return AsyncGRPOTrainer(**base)


def test_a_valid_trainer_builds(tmp_path):
    trainer = _make(tmp_path)
    assert trainer.loop_cls.__name__ == "AsyncRolloutLoop"


def test_plain_text_prompts_are_refused(tmp_path):
    with pytest.raises(ValueError, match="conversational"):
        _make(tmp_path, train_dataset=[{"prompt": "What is 2 + 2?"}])


def test_missing_prompt_column(tmp_path):
    with pytest.raises(ValueError, match="'prompt' column"):
        _make(tmp_path, train_dataset=[{"question": "x"}])


def test_lambda_reward_is_refused_with_a_fix(tmp_path):
    with pytest.raises(TypeError, match="lambda|module"):
        _make(tmp_path, reward_funcs=[lambda completions, **kw: [1.0] * len(completions)])


def test_tools_are_refused_until_agents_land(tmp_path):
    with pytest.raises(NotImplementedError, match="tools"):
        _make(tmp_path, tools=[reward])


def test_lora_on_lm_head_is_refused(tmp_path):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="lm_head"):
        _make(tmp_path, peft_config=LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))

"""AsyncGRPOTrainer refuses bad input at construction, with messages that say what to change."""

import pytest
import torch

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.assets import smollm2_tokenizer, tiny_model

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


def test_tools_need_a_schema_and_environments_need_data_or_max_steps(tmp_path):
    from tests.unit.agent_tools_mod import CounterEnv, multiply

    with pytest.raises(TypeError, match="Google-style docstring"):
        _make(tmp_path, tools=[reward])  # no docstring: transformers cannot build its schema
    with pytest.raises(TypeError, match="lambda"):
        _make(tmp_path, tools=[lambda a: a])
    with pytest.raises(ValueError, match="max_steps"):
        _make(tmp_path, train_dataset=None, environment_factory=CounterEnv)
    with pytest.raises(ValueError, match="'environment' column"):
        _make(tmp_path, environment_factory={"a": CounterEnv, "b": CounterEnv})
    trainer = _make(
        tmp_path, tools=[multiply], train_dataset=None, environment_factory=CounterEnv,
        args=AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], max_steps=2),
    )  # fmt: skip
    assert trainer.tools == [multiply] and list(trainer.environment_factory) == [""]
    assert "<tools>" in trainer.processing_class.chat_template  # the patched tool template


def test_lora_on_lm_head_is_refused(tmp_path):
    from peft import LoraConfig

    with pytest.raises(ValueError, match="lm_head"):
        _make(tmp_path, peft_config=LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))


def test_router_aux_loss_coef_needs_a_moe_model(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], router_aux_loss_coef=0.01)
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        _make(tmp_path, args=args)
    trainer = _make(tmp_path, model=tiny_model("qwen3_moe"), args=args)  # an MoE model trains with it (L6)
    assert trainer.router_aux_coef == 0.01 and trainer.router_top_k == 2
    default = _make(tmp_path, model=tiny_model("qwen3_moe"))  # None: the model config's own coefficient
    assert default.router_aux_coef == default.model.config.router_aux_loss_coef > 0


def solution_reward(completions, solution, **kwargs):  # the dataset has 'answer', not 'solution'
    return [0.0] * len(completions)


def strict_reward(completions, answer):  # no **kwargs: every call also passes prompts and completion_ids
    return [0.0] * len(completions)


def test_a_reward_with_a_wrong_signature_is_refused_at_construction(tmp_path):
    with pytest.raises(TypeError, match=r"'solution' is never passed.*here: answer"):
        _make(tmp_path, reward_funcs=[solution_reward])
    with pytest.raises(TypeError, match=r"does not accept the keyword\(s\) completion_ids, prompts.*\*\*kwargs"):
        _make(tmp_path, reward_funcs=[strict_reward])
    _make(tmp_path, reward_funcs=[solution_reward], train_dataset=[{**ROWS[0], "solution": "4"}])  # now it is


def test_a_refused_connection_waits_vllm_server_connect_timeout_not_30_minutes(tmp_path):
    import socket
    import time

    from asyncgrpo.errors import ServerTimeoutError

    with socket.socket() as s:  # a local port where nothing listens
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], vllm_server_base_url=url,
                           vllm_server_connect_timeout=1.5)  # fmt: skip
    assert args.vllm_server_timeout == 1800  # the long wait stays for servers that answer but are loading
    trainer = _make(tmp_path, args=args)
    t0 = time.monotonic()
    with pytest.raises(ServerTimeoutError, match=r"nothing listens at .*vllm_server_connect_timeout=1\.5"):
        trainer.train()
    assert time.monotonic() - t0 < 15


def test_the_tree_attention_backend_is_checked_at_construction_and_reaches_the_steps(tmp_path, monkeypatch):
    import asyncgrpo.trainer.trainer as trainer_module

    def config(backend: str) -> AsyncGRPOConfig:
        return AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], tree_attention_backend=backend)

    with pytest.raises(ValueError, match="tree_attention_backend='varlen': .*needs a CUDA device.*'sdpa' or 'auto'"):
        _make(tmp_path, args=config("varlen"))  # this machine's trainer runs on CPU
    assert _make(tmp_path).tree_attention_backend == "sdpa"  # auto, on CPU
    trainer = _make(tmp_path, args=config("sdpa"))
    seen = []
    real = trainer_module.build_plan
    monkeypatch.setattr(
        trainer_module, "build_plan", lambda row, backend, device: seen.append(backend) or real(row, backend, device)
    )
    trainer.step_forward_backward(trainer.model, None, 1.0, keep_metrics=False)
    assert seen == ["sdpa"]


def test_auto_is_settled_again_once_the_runs_token_budget_is_known(tmp_path, monkeypatch):
    from asyncgrpo.trainer import packed_forward
    from asyncgrpo.trainer.packed_forward import settle_tree_backend

    trainer = _make(tmp_path)  # token_budget=None: the server's max_model_len, not known when built
    assert trainer.tree_attention_backend == "sdpa"
    trainer.compile_warmed_up = True
    settle_tree_backend(trainer, 32768)  # on CPU auto stays sdpa: the warm-up stands
    assert trainer.tree_attention_backend == "sdpa" and trainer.compile_warmed_up
    seen = []  # what the trainer passes: its rows' length and the dtype attention runs in (fp32 here)
    monkeypatch.setattr(
        packed_forward,
        "resolve_backend",
        lambda b, device, rows, dtype: seen.append(dtype) or ("varlen" if rows > 8000 else "flex"),
    )
    settle_tree_backend(trainer, 2048)
    assert trainer.tree_attention_backend == "flex" and not trainer.compile_warmed_up  # traced with sdpa: again
    trainer.compile_warmed_up = True
    settle_tree_backend(trainer, 2048)
    assert trainer.compile_warmed_up  # the same kernel: nothing to redo
    settle_tree_backend(trainer, 16384)
    assert trainer.tree_attention_backend == "varlen" and not trainer.compile_warmed_up
    assert set(seen) == {torch.float32}

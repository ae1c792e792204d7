"""``tree_attention_backend`` through AsyncGRPOTrainer on CUDA: the step builds its plans with the configured kernel,
and varlen FlashAttention (K/V widened to the query heads of the tiny model's GQA) gives the gradients FlexAttention
gives on the same row, under the accelerator's bf16 autocast; "auto" picks varlen for long rows, also through
compiled decoder layers.

Run: ``pytest -s -q -m gpu tests/gpu/test_trainer_backend_gpu.py`` (one GPU, about a minute).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def _trainer(tmp_path, token_budget: int, compiled: bool, backend: str = "auto"):
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.assets import smollm2_tokenizer, tiny_model

    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], token_budget=token_budget, bf16=True,
                           tree_attention_backend=backend, cuda_graph_step=False, compile_decoder_layers=compiled,
                           warm_up_compile=False)  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}]
    model = tiny_model("llama").cuda()
    assert model.config.num_attention_heads == 2 * model.config.num_key_value_heads  # widened two ways
    return AsyncGRPOTrainer(model, reward_funcs=[_reward], args=args, train_dataset=rows,
                            processing_class=smollm2_tokenizer())  # fmt: skip


def _varlen_against_flex(trainer, row, monkeypatch) -> float:
    """The worst relative gradient difference of the trainer's varlen step against its flex step on ``row``."""
    import asyncgrpo.trainer.trainer as trainer_module
    from tests.helpers.trainer_steps import step_grads, worst_relative_diff

    seen: list[str] = []
    real = trainer_module.build_plan
    monkeypatch.setattr(trainer_module, "build_plan", lambda row, b, device: seen.append(b) or real(row, b, device))
    varlen = step_grads(trainer, row)
    trainer.tree_attention_backend = "flex"
    flex = step_grads(trainer, row)
    assert seen == ["varlen", "flex"]
    return worst_relative_diff(varlen, flex)


def test_the_trainers_varlen_step_matches_its_flex_step(tmp_path, monkeypatch):
    from tests.helpers.trainer_steps import on_policy_warmup_row

    trainer = _trainer(tmp_path, 1024, compiled=False, backend="varlen")
    assert trainer.tree_attention_backend == "varlen"
    row = on_policy_warmup_row(trainer, 1024, 200)  # groups sharing prompts: paths gathered more than once
    worst = _varlen_against_flex(trainer, row, monkeypatch)
    print(f"\ntrainer step, varlen vs flex (bf16 autocast): worst relative grad diff {worst:.2e}")
    assert worst <= 2e-2


def test_auto_runs_varlen_on_long_rows_through_compiled_layers(tmp_path, monkeypatch):
    """The "auto" backend settles on varlen for a token_budget at the crossover, flex below it; compiled layers run the
    varlen step, and its gradients are the flex step's."""
    from asyncgrpo.packing.attention import VARLEN_FROM_TOKENS
    from tests.helpers.trainer_steps import on_policy_warmup_row

    assert _trainer(tmp_path, VARLEN_FROM_TOKENS // 2, compiled=False).tree_attention_backend == "flex"
    trainer = _trainer(tmp_path, VARLEN_FROM_TOKENS, compiled=True)
    assert trainer.tree_attention_backend == "varlen"
    row = on_policy_warmup_row(trainer, VARLEN_FROM_TOKENS, 1024)
    assert row.num_tokens >= VARLEN_FROM_TOKENS // 4  # a long row (the warm-up rows split the budget)
    worst = _varlen_against_flex(trainer, row, monkeypatch)
    print(f"\nauto at {row.num_tokens} tokens, compiled layers: varlen vs flex worst relative grad diff {worst:.2e}")
    assert worst <= 2e-2

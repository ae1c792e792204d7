"""``tree_attention_backend`` through AsyncGRPOTrainer on CUDA: the step builds its plans with the configured kernel,
and varlen FlashAttention (K/V widened to the query heads of the tiny model's GQA) gives the gradients FlexAttention
gives on the same row, under the accelerator's bf16 autocast, eager layers and no CUDA graphs.

Run: ``pytest -s -q -m gpu tests/gpu/test_trainer_backend_gpu.py`` (one GPU, under a minute).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_the_trainers_varlen_step_matches_its_flex_step(tmp_path, monkeypatch):
    import asyncgrpo.trainer.trainer as trainer_module
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.assets import smollm2_tokenizer, tiny_model
    from tests.helpers.trainer_steps import on_policy_warmup_row, step_grads, worst_relative_diff

    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], token_budget=1024, bf16=True,
                           tree_attention_backend="varlen", cuda_graph_step=False, compile_decoder_layers=False,
                           warm_up_compile=False)  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "answer": "4"}]
    model = tiny_model("llama").cuda()
    assert model.config.num_attention_heads == 2 * model.config.num_key_value_heads  # widened two ways
    trainer = AsyncGRPOTrainer(model, reward_funcs=[_reward], args=args, train_dataset=rows,
                               processing_class=smollm2_tokenizer())  # fmt: skip
    assert trainer.tree_attention_backend == "varlen"
    seen: list[str] = []
    real = trainer_module.build_plan
    monkeypatch.setattr(trainer_module, "build_plan", lambda row, b, device: seen.append(b) or real(row, b, device))
    row = on_policy_warmup_row(trainer, 1024, 200)  # groups sharing prompts: paths gathered more than once

    varlen = step_grads(trainer, row)
    trainer.tree_attention_backend = "flex"
    flex = step_grads(trainer, row)
    assert seen == ["varlen", "flex"]
    worst = worst_relative_diff(varlen, flex)
    print(f"\ntrainer step, varlen vs flex (bf16 autocast): worst relative grad diff {worst:.2e}")
    assert worst <= 2e-2

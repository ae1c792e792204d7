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
    from asyncgrpo.packing import build_plan, packed_hidden_states
    from asyncgrpo.trainer.logprobs import selective_logprobs
    from asyncgrpo.trainer.warmup import warmup_rows

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
    vocab = trainer.model.get_output_embeddings().weight.shape[0]
    row = warmup_rows(1024, 4, 200, vocab, top_n=8)[0]  # groups sharing prompts: paths gathered more than once
    # the warm-up rows' old log-probs (-1) are far from a random model's (about -log(vocab)): the importance-sampling
    # correction drops every token and the gradients are all zero. The model's own log-probs make the ratios 1.
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        on_gpu = row.to("cuda")
        hidden = packed_hidden_states(trainer.model, on_gpu, build_plan(on_gpu, "flex"))
        head = trainer.model.get_output_embeddings().weight
        row.old_logprobs = selective_logprobs(hidden[on_gpu.pred_index], head, on_gpu.target_ids).logprobs.float().cpu()

    def grads():
        trainer.model.zero_grad(set_to_none=True)
        trainer.step_forward_backward(trainer.model, row, float(row.num_trained), keep_metrics=False,
                                      autocast_forward=True)  # fmt: skip
        return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    varlen = grads()
    trainer.tree_attention_backend = "flex"
    flex = grads()
    assert seen == ["varlen", "flex"]
    assert varlen.keys() == flex.keys()
    assert min(float(g.norm()) for g in flex.values()) > 0  # every parameter gets a gradient: the check means something
    worst = max(float((g - flex[n]).norm() / flex[n].norm().clamp(min=1e-12)) for n, g in varlen.items())
    print(f"\ntrainer step, varlen vs flex (bf16 autocast): worst relative grad diff {worst:.2e}")
    assert worst <= 2e-2

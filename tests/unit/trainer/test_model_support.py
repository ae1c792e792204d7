"""Construction-time guard: layers tree packing cannot follow fail with the layer type and what to do.

Models are real transformers classes built from tiny configs on the meta device (no weights needed:
the guard reads the config and the module tree).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.trainer.model_support import check_model_support, model_support_problems

SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}  # fmt: skip
HYBRID = {**SMALL, "num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
          "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4}  # fmt: skip


def _meta(config) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def test_attention_and_deltanet_hybrids_are_accepted():
    from transformers import LlamaConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3Config, Qwen3NextConfig

    for cfg in (LlamaConfig(**SMALL), Qwen3Config(**SMALL), Qwen3_5TextConfig(**HYBRID),
                Qwen3_5MoeTextConfig(num_experts=2, **HYBRID), Qwen3NextConfig(num_experts=0, **HYBRID)):  # fmt: skip
        model = _meta(cfg)
        assert model_support_problems(model) == [], type(model).__name__
        check_model_support(model)


def test_attention_sinks_and_sliding_layers_are_refused():
    from transformers import GptOssConfig

    cfg = GptOssConfig(**SMALL, num_local_experts=2, num_experts_per_tok=1,
                       layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    with pytest.raises(ValueError) as err:
        check_model_support(_meta(cfg))
    msg = str(err.value)
    assert "attention sinks" in msg and "GptOssAttention.sinks" in msg and "without attention sinks" in msg
    assert "'sliding_attention' (layers [0])" in msg and "full attention" in msg


def test_sliding_window_qwen2_is_refused_with_the_fix():
    from transformers import Qwen2Config

    cfg = Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(ValueError, match=r"'sliding_attention' \(layers \[1\]\).*use_sliding_window=False"):
        check_model_support(_meta(cfg))


def test_mistral_style_window_in_every_layer_is_refused_unless_disabled():
    from transformers import MistralConfig

    with pytest.raises(ValueError, match=r"sliding_window=4096.*'sliding_window': None"):
        check_model_support(_meta(MistralConfig(**SMALL)))  # transformers' default window is 4096
    assert model_support_problems(_meta(MistralConfig(**SMALL, sliding_window=None))) == []


def test_other_recurrent_and_conv_layers_are_refused():
    from transformers import Lfm2Config, MambaConfig

    mamba = _meta(MambaConfig(vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2))
    problems = model_support_problems(mamba)
    assert any("MambaMixer" in p and "recurrent state" in p for p in problems), problems
    lfm = _meta(Lfm2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"]))  # fmt: skip
    with pytest.raises(ValueError, match=r"layer type 'conv' \(layers \[0\]\).*Gated DeltaNet"):
        check_model_support(lfm)


def test_an_unknown_deltanet_variant_is_refused():
    """A linear-attention layer without the Qwen3.5/Qwen3-Next projections would be run wrongly: refuse it."""
    from transformers import Qwen3_5TextConfig

    model = _meta(Qwen3_5TextConfig(**HYBRID))

    class OtherGatedDeltaNet(torch.nn.Module):  # e.g. a future layout with one fused projection
        pass

    for layer in model.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn = OtherGatedDeltaNet()
    msg = "\n".join(model_support_problems(model))
    assert "OtherGatedDeltaNet" in msg and "'linear_attention' layers but none" in msg


def test_trainer_construction_runs_the_guard(tmp_path):
    from transformers import GptOssConfig

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.assets import smollm2_tokenizer

    cfg = GptOssConfig(**SMALL, num_local_experts=2, num_experts_per_tok=1)
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[])
    with pytest.raises(ValueError, match="attention sinks"):
        AsyncGRPOTrainer(model=_meta(cfg), reward_funcs=[], args=args, processing_class=smollm2_tokenizer(),
                         train_dataset=[{"prompt": [{"role": "user", "content": "hi"}]}])  # fmt: skip

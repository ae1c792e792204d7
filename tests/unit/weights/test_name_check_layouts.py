"""``check_round`` against checkpoint layouts that differ from the trainer's names without being wrong."""

from __future__ import annotations

import logging

import pytest
import torch

from asyncgrpo.weights.collectives import TensorMeta
from asyncgrpo.weights.name_check import ServerWeights, check_round


def _moe_checkpoint(experts: int = 2) -> ServerWeights:
    """A layer as a Qwen3-MoE checkpoint stores it: one tensor per expert (transformers 5 fuses them at load)."""
    shapes = {"model.layers.0.self_attn.q_proj.weight": (8, 8), "model.layers.0.mlp.gate.weight": (experts, 8)}
    for e in range(experts):
        for proj, shape in (("gate_proj", (4, 8)), ("up_proj", (4, 8)), ("down_proj", (8, 4))):
            shapes[f"model.layers.0.mlp.experts.{e}.{proj}.weight"] = shape
    return ServerWeights(shapes, "tiny-moe (1 safetensors file(s))")


def _meta(name: str, *shape: int) -> TensorMeta:
    return TensorMeta(name=name, dtype=torch.float32, shape=shape)


FUSED_LAYER = [
    _meta("model.layers.0.self_attn.q_proj.weight", 8, 8),
    _meta("model.layers.0.mlp.gate.weight", 2, 8),
    _meta("model.layers.0.mlp.experts.gate_up_proj", 2, 8, 8),  # the in-memory names of transformers 5
    _meta("model.layers.0.mlp.experts.down_proj", 2, 8, 4),
]


def test_fused_expert_names_pass_when_the_checkpoint_stores_them_per_expert(caplog):
    with caplog.at_level(logging.INFO, logger="asyncgrpo.weights.name_check"):
        check_round(FUSED_LAYER, _moe_checkpoint(), "http://server")
    assert "2 weight names" in caplog.text and "not checked" in caplog.text


def test_a_wrong_name_beside_fused_experts_is_still_refused():
    metas = [*FUSED_LAYER, _meta("model.layers.0.mlp.gate.bias", 2)]  # the gate has no bias in the checkpoint
    with pytest.raises(ValueError, match=r"unknown to the server: model\.layers\.0\.mlp\.gate\.bias"):
        check_round(metas, _moe_checkpoint(), "http://server")


def test_a_wrong_shape_is_still_refused_in_an_moe_checkpoint():
    metas = [*FUSED_LAYER[:1], _meta("model.layers.0.mlp.gate.weight", 3, 8), *FUSED_LAYER[2:]]
    with pytest.raises(ValueError, match=r"mlp\.gate\.weight: trainer \[3, 8\], server \[2, 8\]"):
        check_round(metas, _moe_checkpoint(), "http://server")

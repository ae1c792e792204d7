"""Tiny OLMoE- and Qwen3-MoE-shaped checkpoints whose routing matters: many experts, large expert outputs.

A random-init tiny MoE adds little to the residual stream, so a different expert choice barely moves a
log-prob; scaling the experts' output projections makes each routing decision count, as in a trained model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from asyncgrpo.assets.demo_model import smollm2_tokenizer_dir
from asyncgrpo.assets.tiny import tiny_model

# arch -> (experts, top-k); OLMoE keeps its un-normalised top-k weights, Qwen3-MoE renormalises
SHAPES = {"olmoe": (32, 4), "qwen3_moe": (16, 4)}
EXPERT_SCALE = 30.0


def sharp_moe_dir(arch: str, out: Path, seed: int = 0) -> Path:
    """Write the tiny ``arch`` MoE (experts' ``down_proj`` x ``EXPERT_SCALE``) and the SmolLM2 tokenizer to ``out``."""
    experts, top_k = SHAPES[arch]
    model = tiny_model(arch, seed=seed, num_experts=experts, num_experts_per_tok=top_k)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "experts.down_proj" in name:
                p.mul_(EXPERT_SCALE)
    model.save_pretrained(out)
    for f in smollm2_tokenizer_dir().iterdir():
        shutil.copy(f, out / f.name)
    return out

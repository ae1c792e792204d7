"""Which models the packed trainer can train exactly, checked once at ``AsyncGRPOTrainer`` construction.

Tree packing puts several samples, and sibling branches of one sample tree, in one row. That is
exact only for layers that mix tokens along trie paths: full attention (tree attention masks it)
and the Gated DeltaNet linear attention of Qwen3.5/Qwen3.5-MoE/Qwen3-Next (``packing/deltanet.py``).
Anything else would silently read a sibling branch's tokens or state, so it fails here with the
layer type and what to do. Other helpers extend ``check_model_support`` (MoE, vision-language
models) by adding their own checks to ``CHECKS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from asyncgrpo.packing.deltanet import deltanet_layout

SUPPORTED_LAYER_TYPES = ("full_attention", "linear_attention")
# class-name fragments of token mixers that carry a recurrent state or a short convolution
STATEFUL_MIXER_NAMES = ("deltanet", "mamba", "shortconv", "linearattention", "rwkv", "recurrent", "lstm", "ssm")
_WINDOWED = ("sliding_attention", "chunked_attention", "local_attention", "hybrid_sliding")


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def _layer_type_problems(model: Any) -> list[str]:
    name = type(model).__name__
    cfg = _text_config(model)
    types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    if not types and window and getattr(cfg, "use_sliding_window", True):  # Mistral-style: a window in every layer
        msg = (
            f"{name} uses sliding-window attention in every layer (sliding_window={window}) and tree attention has "
            f"no sliding-window mask. If no sample is longer than {window} tokens the window changes nothing: set "
            "model_init_kwargs={'sliding_window': None} (or model.config.sliding_window = None on a model you pass); "
            "otherwise train a full-attention model"
        )
        return [msg]
    where: dict[str, list[int]] = {}
    for i, t in enumerate(types):
        if t not in SUPPORTED_LAYER_TYPES:
            where.setdefault(str(t), []).append(i)
    problems = []
    for t, layers in where.items():
        if t in _WINDOWED:
            fix = (
                "tree attention has no sliding-window/chunked mask; train a model whose layers all use full "
                "attention (for Qwen2/Qwen3-style configs set use_sliding_window=False)"
            )
        else:
            fix = (
                "the packer understands only full attention and Gated DeltaNet linear attention "
                "(Qwen3.5, Qwen3.5-MoE, Qwen3-Next); train one of those or a plain transformer"
            )
        problems.append(f"{name} has layer type {t!r} (layers {layers}): {fix}")
    return problems


def _module_problems(model: torch.nn.Module) -> list[str]:
    name = type(model).__name__
    problems: list[str] = []
    seen: set[tuple[str, str]] = set()
    known_linear = 0
    for path, m in model.named_modules():
        cls = type(m).__name__
        if isinstance(getattr(m, "sinks", None), torch.Tensor) and ("sinks", cls) not in seen:
            seen.add(("sinks", cls))
            problems.append(
                f"{name} has attention sinks ({cls}.sinks, gpt-oss style, e.g. at {path}): tree packing does not "
                "implement sink logits (docs/spec.md, P1); train a model without attention sinks"
            )
        if deltanet_layout(m) is not None:
            known_linear += 1
        elif any(k in cls.lower() for k in STATEFUL_MIXER_NAMES) and ("mixer", cls) not in seen:
            seen.add(("mixer", cls))
            problems.append(
                f"{name} has a {cls} layer (at {path}) that keeps a recurrent state or a short convolution the packer "
                "does not understand: packed rows would leak sibling branches into it. Only Gated DeltaNet layers "
                "(Qwen3.5, Qwen3.5-MoE, Qwen3-Next) follow the trie; train one of those or a plain transformer"
            )
    types = getattr(_text_config(model), "layer_types", None) or []
    if "linear_attention" in types and not known_linear:
        problems.append(
            f"{name} declares 'linear_attention' layers but none is a Gated DeltaNet layer the packer knows "
            "(Qwen3.5/Qwen3-Next layout: conv1d, A_log, dt_bias and in_proj_qkv/z/b/a or in_proj_qkvz/ba)"
        )
    if getattr(model, "_is_stateful", False) and not known_linear and not problems:
        problems.append(
            f"{name} keeps recurrent state between tokens (transformers marks it stateful) in layers the packer does "
            "not know; only Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) are supported among recurrent models"
        )
    return problems


CHECKS: list[Callable[[Any], list[str]]] = [_layer_type_problems, _module_problems]


def model_support_problems(model: Any) -> list[str]:
    """Every reason ``model`` (a transformers model, before any PEFT wrapping) cannot be tree-packed exactly."""
    problems: list[str] = []
    for check in CHECKS:
        problems.extend(check(model))
    return problems


def check_model_support(model: Any) -> None:
    """Raise ``ValueError`` listing every layer of ``model`` the packed trainer cannot train exactly."""
    problems = model_support_problems(model)
    if problems:
        raise ValueError("this model cannot be trained with tree packing:\n- " + "\n- ".join(problems))

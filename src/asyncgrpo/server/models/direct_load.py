"""A native family's checkpoint loaded without transformers: ``config.json`` and the safetensors files, read directly.

Why: the engine process imported transformers only to load a Llama/Mistral/Qwen2/Qwen3 checkpoint into modules whose
forward it never runs (``decoder.py`` runs its own). On an H200 that import was 4.3 s of a warm server start and 5.4 s
of a cold one (bench/LOG.md, issue 41), and it held the GIL that the Triton compile thread beside it needs.

Here the same parameter tree is built (transformers' names, shapes, dtype and tied embeddings, so a weight update by
name lands where it did) and filled from the ``*.safetensors`` files, and the RoPE tables come from the same float32
arithmetic as transformers' default rotary embedding. Whatever this does not cover exactly returns None, and the
engine loads through transformers as before: another family, RoPE scaling, an activation other than SiLU, sliding
windows in Qwen2/Qwen3, quantisation, a checkpoint that is not safetensors, or tensors other than the expected ones.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from asyncgrpo.server.models.decoder import SUPPORTED_ARCHITECTURES, resolve_device, resolve_dtype

logger = logging.getLogger(__name__)

FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM"}  # fmt: skip
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
            "rms_norm_eps", "max_position_embeddings")  # fmt: skip
IGNORED_SUFFIX = ".rotary_emb.inv_freq"  # a buffer some older checkpoints saved; transformers skips it too


class DirectConfig(SimpleNamespace):
    """``config.json``'s fields as attributes (what the engine reads of a transformers config)."""

    def get_text_config(self, *args: Any, **kwargs: Any) -> DirectConfig:
        return self


class DirectCausalLM(nn.Module):
    """The parameter tree of a ``*ForCausalLM`` (``model.embed_tokens``, ``model.layers.N...``, ``model.norm``,
    ``lm_head``) without its forward: :class:`~asyncgrpo.server.models.decoder.DecoderLM` runs over it."""

    def __init__(self, config: DirectConfig, generation_config: DirectConfig | None) -> None:
        super().__init__()
        self.config, self.generation_config = config, generation_config


class _Weights(nn.Module):
    """A module holding parameters under the given attribute names (a Linear's weight/bias, a norm's weight)."""

    def __init__(self, eps: float | None = None, **params: torch.Tensor) -> None:
        super().__init__()
        for name, value in params.items():
            setattr(self, name, nn.Parameter(value, requires_grad=False))
        if eps is not None:
            self.variance_epsilon = eps


class DefaultRotary(nn.Module):
    """transformers' default RoPE: inverse frequencies in float32 on the CPU, then position x frequency in float32."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def load_direct(model: Any, dtype: str | torch.dtype, device: str | torch.device,
                part: Callable[[str], None]) -> DirectCausalLM | None:  # fmt: skip
    """The checkpoint folder ``model`` as a :class:`DirectCausalLM` on ``device``, or None where transformers must
    load it (the reason is logged at debug level)."""
    if not isinstance(model, (str, os.PathLike)) or not (Path(model) / "config.json").is_file():
        return None
    folder = Path(model)
    try:
        raw = json.loads((folder / "config.json").read_text())
        why, files = _unsupported(raw), _safetensors_files(folder)
    except (OSError, ValueError) as exc:
        why, files = f"unreadable: {exc}", []
    if why or not files:
        logger.debug("%s loads through transformers: %s", folder, why or "no safetensors files")
        return None
    from safetensors import safe_open

    cfg = DirectConfig(**{"hidden_act": "silu", **raw})  # the four families' default activation
    dev = resolve_device(device)
    want = resolve_dtype(dtype, cfg, dev)
    part("config")
    if dev.type == "cuda":  # the CUDA context here, as the transformers path makes it, so the start split shows it
        torch.zeros(1, device=dev)
        part("cuda_init")
    expected = _expected_shapes(raw)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device=str(dev)) as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open is no mapping
                if not key.endswith(IGNORED_SUFFIX):
                    tensors[key] = fh.get_tensor(key).to(want)
    if set(tensors) != set(expected) or any(tuple(tensors[k].shape) != s for k, s in expected.items()):
        extra, missing = sorted(set(tensors) - set(expected))[:3], sorted(set(expected) - set(tensors))[:3]
        logger.debug("%s loads through transformers: tensors differ (extra %s, missing %s)", folder, extra, missing)
        return None
    part("safetensors")
    lm = _assemble(cfg, raw, tensors, _generation_config(folder))
    lm.eval()
    part("to_device")
    logger.info("loaded %s directly from its safetensors (%s, %s): transformers not imported", folder.name, want, dev)
    return lm


def _unsupported(raw: dict[str, Any]) -> str | None:
    """Why this config is not loaded here (None: it is)."""
    family = raw.get("model_type")
    if FAMILIES.get(family) not in (raw.get("architectures") or []) or FAMILIES[family] not in SUPPORTED_ARCHITECTURES:
        return f"model_type {family!r} / architectures {raw.get('architectures')}"
    if missing := [k for k in REQUIRED if raw.get(k) is None]:
        return f"config fields missing: {missing}"
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {raw.get('hidden_act')!r}"
    if raw.get("quantization_config"):
        return "quantized"
    if raw.get("use_sliding_window") or "sliding_attention" in (raw.get("layer_types") or []):
        return "sliding-window layers"
    rope, scaling = raw.get("rope_parameters") or {}, raw.get("rope_scaling")
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind != "default" or (scaling and (scaling.get("rope_type") or scaling.get("type")) != "default"):
        return f"rope type {kind!r} / rope_scaling {scaling}"
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        return "partial rotary"
    if _theta(raw) is None:
        return "no rope_theta"
    return None


def _theta(raw: dict[str, Any]) -> float | None:
    value = (raw.get("rope_parameters") or {}).get("rope_theta", raw.get("rope_theta"))
    return float(value) if value is not None else None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def _head_dim(raw: dict[str, Any]) -> int:
    return int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"])


def _biases(raw: dict[str, Any]) -> tuple[tuple[str, ...], bool]:
    """The attention projections with a bias, and whether the MLP's have one (as each family's modules declare)."""
    family = raw["model_type"]
    if family == "qwen2":
        return ("q_proj", "k_proj", "v_proj"), False
    if family == "mistral":
        return (), False
    attn = ("q_proj", "k_proj", "v_proj", "o_proj") if raw.get("attention_bias") else ()
    return attn, family == "llama" and bool(raw.get("mlp_bias"))


def _expected_shapes(raw: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape (``lm_head.weight`` only when not tied)."""
    hidden, inter, vocab = int(raw["hidden_size"]), int(raw["intermediate_size"]), int(raw["vocab_size"])
    heads, hd = int(raw["num_attention_heads"]), _head_dim(raw)
    kv = int(raw.get("num_key_value_heads") or heads)
    attn_bias, mlp_bias = _biases(raw)
    out = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not raw.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (vocab, hidden)
    sizes = {"q_proj": (heads * hd, hidden), "k_proj": (kv * hd, hidden), "v_proj": (kv * hd, hidden),
             "o_proj": (hidden, heads * hd)}  # fmt: skip
    for i in range(int(raw["num_hidden_layers"])):
        p = f"model.layers.{i}."
        for name, shape in sizes.items():
            out[f"{p}self_attn.{name}.weight"] = shape
            if name in attn_bias:
                out[f"{p}self_attn.{name}.bias"] = (shape[0],)
        for name, shape in (
            ("gate_proj", (inter, hidden)),
            ("up_proj", (inter, hidden)),
            ("down_proj", (hidden, inter)),
        ):
            out[f"{p}mlp.{name}.weight"] = shape
            if mlp_bias:
                out[f"{p}mlp.{name}.bias"] = (shape[0],)
        out[f"{p}input_layernorm.weight"] = out[f"{p}post_attention_layernorm.weight"] = (hidden,)
        if raw["model_type"] == "qwen3":
            out[f"{p}self_attn.q_norm.weight"] = out[f"{p}self_attn.k_norm.weight"] = (hd,)
    return out


def _assemble(cfg: DirectConfig, raw: dict[str, Any], t: dict[str, torch.Tensor],
              generation_config: DirectConfig | None) -> DirectCausalLM:  # fmt: skip
    """The module tree over the loaded tensors (each used in place)."""
    eps = float(raw["rms_norm_eps"])

    def linear(prefix: str) -> _Weights:
        module = _Weights(weight=t[prefix + ".weight"])
        module.register_parameter("bias", nn.Parameter(t[prefix + ".bias"], requires_grad=False)
                                  if prefix + ".bias" in t else None)  # fmt: skip
        return module

    def norm(prefix: str) -> _Weights:
        return _Weights(eps=eps, weight=t[prefix + ".weight"])

    layers = nn.ModuleList()
    for i in range(int(raw["num_hidden_layers"])):
        p = f"model.layers.{i}."
        attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, linear(p + "self_attn." + name))
        if raw["model_type"] == "qwen3":
            attn.q_norm, attn.k_norm = norm(p + "self_attn.q_norm"), norm(p + "self_attn.k_norm")
        mlp = nn.Module()
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(mlp, name, linear(p + "mlp." + name))
        layer = nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        layer.input_layernorm, layer.post_attention_layernorm = (
            norm(p + "input_layernorm"),
            norm(p + "post_attention_layernorm"),
        )
        layers.append(layer)
    lm = DirectCausalLM(cfg, generation_config)
    lm.model = nn.Module()
    lm.model.embed_tokens = _Weights(weight=t["model.embed_tokens.weight"])
    lm.model.layers = layers
    lm.model.norm = norm("model.norm")
    lm.model.rotary_emb = DefaultRotary(_head_dim(raw), float(_theta(raw)))  # type: ignore[arg-type]
    lm.lm_head = nn.Module()
    if "lm_head.weight" in t:
        lm.lm_head.weight = nn.Parameter(t["lm_head.weight"], requires_grad=False)
    else:  # tied: one parameter under both names, as transformers ties them
        lm.lm_head.weight = lm.model.embed_tokens.weight
    return lm


def _generation_config(folder: Path) -> DirectConfig | None:
    path = folder / "generation_config.json"
    return DirectConfig(**json.loads(path.read_text())) if path.is_file() else None

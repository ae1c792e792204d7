"""The engine's general model path: any HF causal LM (or a vision-language checkpoint, text only) through its own forward.

``decoder.py`` runs a compact forward of its own for Llama/Mistral/Qwen2/Qwen3. Every other family the trainer
accepts (Gated DeltaNet hybrids such as Qwen3.5/Qwen3-Next, MoE models, vision-language checkpoints) goes here:
the model's own ``forward`` with the model's own cache object (``DynamicCache`` or, for DeltaNet hybrids, the
cache that also holds convolution and recurrent state). It is slower, but everything after the logits — the
sampler, processed log-probs, top-N, masks, seeds — and the scheduler are shared with the native path, so
outputs agree with an HF forward on the same tokens.

A vision-language checkpoint (its config has ``vision_config``) loads through ``AutoModelForImageTextToText``,
like the trainer loads it, so parameter names (``model.language_model.*``, ``lm_head.*``) match the names the
trainer sends; its vision tower is loaded but never run (image prompts are refused upstream).

The runner that steps this forward with the model's own caches is ``engine/general_runner.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from asyncgrpo.files import local_only
from asyncgrpo.models.vlm import is_vision_language
from asyncgrpo.server.lean_imports import without_unused_packages
from asyncgrpo.server.models.decoder import SUPPORTED_ARCHITECTURES, resolve_device, resolve_dtype
from asyncgrpo.server.models.direct_load import DirectCausalLM, load_direct

logger = logging.getLogger(__name__)


def architecture_of(hf_model: nn.Module) -> str:
    archs = list(getattr(hf_model.config, "architectures", None) or [])
    return archs[0] if archs else type(hf_model).__name__


def is_native(hf_model: nn.Module) -> bool:
    """True for the families :class:`~asyncgrpo.server.models.decoder.DecoderLM` runs itself."""
    archs = list(getattr(hf_model.config, "architectures", None) or []) or [type(hf_model).__name__]
    own = isinstance(hf_model, DirectCausalLM) or type(hf_model).__name__ in SUPPORTED_ARCHITECTURES
    return own and any(a in SUPPORTED_ARCHITECTURES for a in archs)


def _no_part(name: str) -> None:
    """Where no start clock is given: parts are not timed."""


def load_any_model(
    model: str | os.PathLike | nn.Module,
    dtype: str | torch.dtype,
    device: str | torch.device,
    part: Callable[[str], None] = _no_part,
):
    """An HF model on ``device`` in the resolved dtype, eval mode, no grads; from a directory or an instance.

    A safetensors folder of a native family loads without transformers (``direct_load.py``); other causal LMs
    load through ``AutoModelForCausalLM``, vision-language checkpoints through
    ``AutoModelForImageTextToText``. An instance is used in place (its weights are shared, not copied).
    ``part``: the start clock's :meth:`~asyncgrpo.server.start_clock.StartClock.part`, called after each step.
    """
    direct = load_direct(model, dtype, device, part)  # a native family's safetensors folder: no transformers
    if direct is not None:
        return direct
    with without_unused_packages():  # the import and from_pretrained (which imports the modeling module)
        return _load(model, dtype, device, part)


def _load(model: str | os.PathLike | nn.Module, dtype: str | torch.dtype, device: str | torch.device,
          part: Callable[[str], None]):  # fmt: skip
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    part("transformers_import")
    dev = resolve_device(device)
    if dev.type == "cuda":  # the CUDA context, made here rather than at the first weight, so the split shows it
        torch.zeros(1, device=dev)
        part("cuda_init")
    if isinstance(model, nn.Module):
        hf = model
        want = resolve_dtype(dtype, hf.config, dev) if dtype != "auto" else hf.dtype
        if dev.type == "cpu" and dtype == "auto":
            want = torch.float32
        hf = hf.to(device=dev, dtype=want)
    else:
        config = AutoConfig.from_pretrained(model, **local_only(model))
        # a vision-language config may keep the checkpoint dtype in its text config only
        has_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        want = resolve_dtype(dtype, config if has_dtype else _text_config(config), dev)
        auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        part("config")
        _import_modeling(auto, config)
        part("modeling_import")
        kwargs = {"device_map": str(dev)} if dev.type == "cuda" else {}
        try:
            hf = auto.from_pretrained(model, dtype=want, **kwargs, **local_only(model))
        except ValueError as exc:
            raise ValueError(
                f"{model}: transformers cannot load this checkpoint as a causal LM or a vision-language model "
                f"({exc}); the embedded server serves models that AutoModelForCausalLM or "
                "AutoModelForImageTextToText load"
            ) from exc
        part("from_pretrained")
        hf = hf.to(dev)
    hf.eval()
    hf.requires_grad_(False)
    part("to_device")
    return hf


def _import_modeling(auto: Any, config: Any) -> None:
    """Import the model's modeling module before ``from_pretrained`` (which would import it first thing), so a start
    split tells the import from the weights. Only a timing aid: a mapping transformers keeps privately, so any error
    leaves the import to ``from_pretrained``."""
    try:
        auto._model_mapping[type(config)]
    except Exception as exc:  # noqa: BLE001 - e.g. a remote-code model, or a renamed private mapping
        logger.debug("modeling module not imported ahead of from_pretrained: %s", exc)


def text_model_aliases(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A vision-language model's text weights also under the names a causal-LM load of its text model uses
    (``model.language_model.X`` -> ``model.X``), where that name is free."""
    prefix = "model.language_model."
    return {
        "model." + name[len(prefix) :]: p
        for name, p in params.items()
        if name.startswith(prefix) and "model." + name[len(prefix) :] not in params
    }


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


class GeneralLM:
    """The facts the engine needs about a model it runs through HF's forward (sizes, dtype, device, names).

    ``num_kv_layers``/``num_kv_heads``/``head_dim`` size the engine's block accounting (the KV cache itself
    lives in each sequence's HF cache object); ``layers`` is empty because the engine allocates no paged cache.
    """

    def __init__(self, hf_model: nn.Module) -> None:
        self.hf_model = hf_model
        self.arch = architecture_of(hf_model)
        cfg = _text_config(hf_model.config)
        self.config = cfg
        self.layers: list = []
        types = list(getattr(cfg, "layer_types", None) or [])
        n_layers = int(getattr(cfg, "num_hidden_layers", 1) or 1)
        self.num_kv_layers = max(1, sum(t == "full_attention" for t in types) if types else n_layers)
        heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        hidden = int(getattr(cfg, "hidden_size", heads) or heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        self.hidden_size = hidden
        self.intermediate_size = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
        emb = hf_model.get_input_embeddings()
        self.dtype = emb.weight.dtype
        self.device = emb.weight.device
        out = hf_model.get_output_embeddings()
        self.vocab_size = int(out.weight.shape[0] if out is not None else emb.weight.shape[0])

"""Vision-language checkpoints trained on text only (T4 in docs/spec.md).

A checkpoint whose config has a ``vision_config`` loads through ``AutoModelForImageTextToText``. Only its text
model is trained: everything outside it (vision tower, projector/merger) gets ``requires_grad=False`` — so no
gradient and no optimizer state — and is left out of weight sync and of the weight metadata, so the server keeps
the tower it loaded from the checkpoint. Text-only prompts produce no image tokens, so the tower never runs.
Prompts with images are refused: the packed trainer forward has no 3D M-RoPE positions for image grids.

Used by the trainer (loading, freezing), the weight sender (what is synced) and the dataset checks.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncgrpo.files import local_only

logger = logging.getLogger(__name__)

IMAGE_COLUMNS = ("images", "image")
IMAGE_PART_TYPES = ("image", "image_url", "input_image", "video", "video_url")


def is_vision_language(config: Any) -> bool:
    """A vision-language config: it carries a ``vision_config``."""
    return getattr(config, "vision_config", None) is not None


def load_pretrained(model_id: str, **kwargs: Any) -> torch.nn.Module:
    """The checkpoint through ``AutoModelForImageTextToText`` if it is a vision-language one, else
    ``AutoModelForCausalLM`` (as the reference loads models, T4 in docs/spec.md)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config_kwargs = {"trust_remote_code": kwargs["trust_remote_code"]} if "trust_remote_code" in kwargs else {}
    local = local_only(model_id)
    config = AutoConfig.from_pretrained(model_id, **config_kwargs, **local)
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    return auto.from_pretrained(model_id, **{**local, **kwargs})


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    get_base = getattr(model, "get_base_model", None)  # a PEFT wrapper
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def non_text_parameter_ids(model: torch.nn.Module) -> set[int]:
    """``id()`` of every parameter outside the text model and its LM head; empty for a text-only model.

    The text model is ``get_decoder()`` (the language model of a vision-language model); works through a PEFT
    wrapper (LoRA factors inside the tower count as tower parameters).
    """
    base = _unwrapped(model)
    if not is_vision_language(getattr(base, "config", None)):
        return set()
    decoder = base.get_decoder()
    keep = {id(p) for p in decoder.parameters()}
    head = base.get_output_embeddings()
    if head is not None:
        keep |= {id(p) for p in head.parameters()}
    if not keep:
        raise ValueError(f"{type(base).__name__}: could not find its text model (get_decoder() has no parameters)")
    return {id(p) for p in model.parameters() if id(p) not in keep}


def freeze_non_text(model: torch.nn.Module) -> int:
    """``requires_grad=False`` on everything outside the text model; returns how many parameters were frozen."""
    tower = non_text_parameter_ids(model)
    n = 0
    for p in model.parameters():
        if id(p) in tower:
            p.requires_grad_(False)
            n += p.numel()
    if tower:
        logger.info("vision-language checkpoint: %d parameters outside the text model frozen and not synced", n)
    return n


def _image_parts(content: Any) -> list[str]:
    if not isinstance(content, list):
        return []
    return [
        str(part.get("type")) for part in content if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
    ]


def check_no_images(row: Any, where: str) -> None:
    """ValueError when a dataset row (or a conversation) carries images; text-only training is all there is."""
    if isinstance(row, dict):
        cols = [c for c in IMAGE_COLUMNS if row.get(c) is not None and row.get(c) != []]
        if cols:
            raise ValueError(
                f"{where} has an {cols[0]!r} column: prompts with images are not supported (the packed trainer forward "
                "has no image positions); train vision-language models on text-only prompts and drop the column"
            )
        messages = row.get("prompt")
    else:
        messages = row
    for message in messages if isinstance(messages, list) else []:
        parts = _image_parts(message.get("content")) if isinstance(message, dict) else []
        if parts:
            raise ValueError(
                f"{where} has a message with a {parts[0]!r} content part: prompts with images are not supported; "
                "train vision-language models on text-only prompts"
            )

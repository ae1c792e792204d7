"""Which tensors the server gets after an optimizer step (G10, T6 merged mode).

The server loads weights by their Hugging Face checkpoint names. A plain model
sends its parameters as they are (a tied LM head once, as the embedding). A PEFT
model sends *merged* weights — ``W + scale · B A`` for every LoRA-wrapped
layer — under the base model's names, so any server (vLLM or embedded) needs no
adapter support. Sharded (FSDP2/DTensor) parameters are gathered one tensor at a
time, so no rank ever holds more than one full tensor beyond its shard.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

_PEFT_PREFIX = "base_model.model."


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a possibly sharded parameter (collective on every rank for a DTensor)."""
    full_tensor = getattr(t, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else t


def _is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, full detached tensor)`` of every weight the server needs, in a fixed order."""
    if not _is_peft(model):
        for name, p in model.named_parameters():
            yield name, _full(p.detach())
        return
    merged_layers = {}
    for mod_name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
            merged_layers[mod_name] = module
    adapter = getattr(model, "active_adapter", "default")
    if isinstance(adapter, list):
        adapter = adapter[0]
    for name, p in model.named_parameters():
        if "lora_" in name or "modules_to_save" in name and ".original_module." in name:
            continue
        owner = name.rsplit(".", 2)[0] if ".base_layer." in name else None
        tensor = _full(p.detach())
        if owner is not None and owner in merged_layers and name.endswith("base_layer.weight"):
            layer = merged_layers[owner]
            if adapter in layer.lora_A and not getattr(layer, "merged", False):
                tensor = tensor + _full(layer.get_delta_weight(adapter).detach()).to(tensor.dtype)
        clean = name.removeprefix(_PEFT_PREFIX)
        clean = clean.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        yield clean, tensor


@torch.no_grad()
def policy_weight_metadata(model: torch.nn.Module) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of :func:`policy_weights` without materialising merged tensors."""
    out = []
    for name, t in policy_weights(model):
        out.append((name, t.dtype, tuple(t.shape)))
    return out

"""Find the top-k routers of a transformers mixture-of-experts model (the server's capture and the trainer's replay).

transformers 5 MoE blocks (OLMoE, Qwen3-MoE, Qwen2-MoE, Qwen3-Next, ...) call a router module ``mlp.gate`` that
returns ``(router_logits, top_k_weights, top_k_ids)``; both ends hook that module, so they find it the same way.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ROUTER_NAMES = ("gate", "router")


def router_modules(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(decoder layer index, router module)`` of every MoE layer, in layer order.

    A router is a ``gate``/``router`` submodule of a decoder layer's MLP block that knows its ``top_k`` (the
    transformers 5 top-k routers); plain linear gates of dense MLPs (``gate_proj``) do not match.
    """
    found: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        match = _LAYER.search(name)
        if leaf in _ROUTER_NAMES and match and getattr(module, "top_k", None) and hasattr(module, "weight"):
            found.setdefault(int(match.group(1)), module)
    return sorted(found.items(), key=lambda kv: kv[0])


def routing_shape(config: Any) -> tuple[int, int, int]:
    """``(num_hidden_layers, num_experts, num_experts_per_tok)`` of an MoE text config (0 experts: dense)."""
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    experts = int(
        getattr(config, "num_experts", None)
        or getattr(config, "num_local_experts", None)
        or getattr(config, "n_routed_experts", None)
        or 0
    )
    top_k = int(getattr(config, "num_experts_per_tok", None) or 0)
    return layers, experts, top_k

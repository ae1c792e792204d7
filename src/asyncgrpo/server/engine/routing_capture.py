"""Capture the experts each MoE router chose, for ``--enable-return-routed-experts`` (vLLM 0.33's flag).

The general (HF forward) path runs transformers' own MoE blocks. Their routers (``OlmoeTopKRouter``,
``Qwen3MoeTopKRouter``, ...: a ``mlp.gate`` module under ``layers.<i>``) return ``(router_logits, weights,
expert_ids)``; a forward hook on each copies ``expert_ids`` [tokens, top_k] of the current forward. After the
forward, :meth:`RoutingCapture.take` lays them out as ``[batch, seq, num_hidden_layers, top_k]`` in vLLM's wire
dtype (layers without a router stay 0, as in vLLM's capture buffer). Each sequence keeps its rows
(``Sequence.routed_rows``); the answer carries them as ``asyncgrpo.routed_experts`` describes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from asyncgrpo.models.moe_routers import router_modules, routing_shape
from asyncgrpo.routed_experts import routed_dtype


class RoutingCapture:
    """Forward hooks on every router of ``model``, keeping the expert ids of the latest forward.

    Raises:
        ValueError: the model has no experts or no router this capture recognises; the message names the model.
    """

    def __init__(self, model: nn.Module, config: Any) -> None:
        name = type(model).__name__
        self.num_layers, num_experts, self.top_k = routing_shape(config)
        if num_experts <= 0 or self.top_k <= 0:
            raise ValueError(
                f"--enable-return-routed-experts needs a mixture-of-experts model; {name} has no experts "
                f"(num_experts={num_experts}, num_experts_per_tok={self.top_k}): drop the flag"
            )
        self.dtype = routed_dtype(num_experts)
        self.routers = router_modules(model)
        if not self.routers:
            raise ValueError(
                f"--enable-return-routed-experts: found no top-k router (a layers.<i>.mlp.gate module with top_k) "
                f"in {name}; the embedded server captures transformers' MoE routers only: drop the flag"
            )
        self._latest: dict[int, torch.Tensor] = {}
        self._handles = [router.register_forward_hook(self._hook(i)) for i, router in self.routers]

    def _hook(self, layer: int):
        def keep(_module: nn.Module, _args: Any, output: Any) -> None:
            ids = output[-1] if isinstance(output, tuple) else None
            if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.shape[-1] != self.top_k:
                raise RuntimeError(
                    f"router of layer {layer} returned no [tokens, {self.top_k}] expert ids as its last output; "
                    "this transformers version's MoE routers are not supported by --enable-return-routed-experts"
                )
            self._latest[layer] = ids.detach()

        return keep

    def take(self, batch: int, seq_len: int) -> np.ndarray:
        """The latest forward's ids as ``[batch, seq_len, num_hidden_layers, top_k]`` (CPU, wire dtype).

        Raises:
            RuntimeError: a router did not run, or saw another number of tokens (a capture/forward mismatch).
        """
        out = np.zeros((batch, seq_len, self.num_layers, self.top_k), dtype=self.dtype)
        for layer, _ in self.routers:
            ids = self._latest.pop(layer, None)
            if ids is None or ids.numel() != batch * seq_len * self.top_k:
                got = None if ids is None else tuple(ids.shape)
                raise RuntimeError(f"router of layer {layer} captured {got} for a [{batch}, {seq_len}] forward")
            out[:, :, layer] = ids.reshape(batch, seq_len, self.top_k).cpu().numpy()  # CPU-GPU sync point
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

"""Run transformers' Gated DeltaNet layers (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) on packed trie rows.

``install_tree_linear_attention(model)`` moves every Gated DeltaNet module to a subclass of its own
class whose ``forward`` takes the trie path, and wraps the ``forward`` of the decoder layer holding
it. While a packed row runs — the decoder layer receives the ``tree_plan`` keyword that tree
attention already travels on — the DeltaNet layer computes its projections with its own weights,
then the trie-aware convolution and delta rule of ``linear_attention.py``, then its own gated norm
and output projection. Without a plan (generation, evaluation, ordinary batches) the layer runs its
original forward untouched.

Why a subclass and not an instance-level ``forward``: transformers 5.25 loads models with hub kernels
on (``use_kernels`` defaults to True once the ``kernels`` package is installed, and transformers now
requires it), and every ``model.train()``/``model.eval()`` that changes the mode runs ``kernelize``
again, which resets each ``@use_kernel_forward_from_hub`` layer (Qwen3.5's ``Qwen3_5GatedDeltaNet``)
to its class's ``forward`` by deleting the instance attribute. An instance wrapper vanished at the
trainer's first ``model.train()`` and packed rows ran the flat causal forward, reading sibling
completions (a 4e-2 log-prob gap to the sampler). The subclass also tells ``kernelize`` to leave the
layer alone (``kernel_condition``), so a hub kernel never replaces the trie path; and the decoder-layer
wrapper checks after every packed call that each of its DeltaNet layers took the trie path.

The decoder-layer wrapper hands the plan to its DeltaNet module as an attribute as well, because
not every transformers version forwards extra keyword arguments from the decoder layer to
``linear_attn``; it sits on the layer that gradient checkpointing recomputes, so the recomputed
forward sees the plan too.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from asyncgrpo.packing.linear_attention import tree_causal_conv, tree_gated_delta_rule

logger = logging.getLogger(__name__)

_PLAN_ATTR = "_asyncgrpo_tree_plan"
_TAKEN_ATTR = "_asyncgrpo_tree_taken"  # set by the trie path; the decoder-layer wrapper checks it
_WRAPPED_ATTR = "_asyncgrpo_tree_wrapped"
_COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "head_k_dim", "head_v_dim", "key_dim", "value_dim")


def deltanet_layout(module: torch.nn.Module) -> str | None:
    """ "split" (Qwen3.5: in_proj_qkv/z/b/a), "fused" (Qwen3-Next: in_proj_qkvz/ba), or None if not understood."""
    if not type(module).__name__.endswith("GatedDeltaNet") or not all(hasattr(module, a) for a in _COMMON):
        return None
    if all(hasattr(module, a) for a in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")):
        return "split"
    if all(hasattr(module, a) for a in ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")):
        return "fused"
    return None


def _project(module: Any, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(mixed qkv [T, 2 key_dim + value_dim], z [T, H_v, D_v], b [T, H_v], a [T, H_v]) from hidden states [T, H]."""
    if deltanet_layout(module) == "split":
        qkv = module.in_proj_qkv(x)
        z = module.in_proj_z(x).view(x.shape[0], -1, module.head_v_dim)
        return qkv, z, module.in_proj_b(x), module.in_proj_a(x)
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x[None]), module.in_proj_ba(x[None]))
    qkv = torch.cat([t.reshape(1, x.shape[0], -1) for t in (q, k, v)], dim=-1)[0]
    return qkv, z[0], b[0], a[0]


def packed_deltanet_forward(module: Any, hidden_states: torch.Tensor, plan: Any) -> torch.Tensor:
    """The layer's output [1, T, hidden] for a packed row; ``plan`` is a ``TreeAttentionPlan`` with ``linear``."""
    from transformers.activations import ACT2FN

    lin = plan.linear
    if lin is None:
        raise RuntimeError("a Gated DeltaNet layer got a packed row without its linear plan; build the plan with "
                           "packing.build_plan(row, linear_attention=True) or call packed_hidden_states")  # fmt: skip
    if hidden_states.shape[0] != 1 or hidden_states.shape[1] != lin.num_tokens:
        raise ValueError(
            f"packed DeltaNet expects one row of {lin.num_tokens} tokens, got {tuple(hidden_states.shape)}"
        )
    x = hidden_states[0]
    n_tok = x.shape[0]
    qkv, z, b, a = _project(module, x)
    conv = module.conv1d
    if not isinstance(conv, torch.nn.Conv1d):  # e.g. a PEFT wrapper: its delta would be ignored below
        raise TypeError(
            f"the DeltaNet conv1d of layer {getattr(module, 'layer_idx', '?')} is a {type(conv).__name__}; adapters on "
            "the short convolution are not supported in packed rows: drop 'conv1d' from the LoRA target_modules"
        )
    mixed = tree_causal_conv(qkv, conv.weight[:, 0, :], conv.bias, lin)
    act = ACT2FN[module.activation] if isinstance(getattr(module, "activation", None), str) else module.act
    mixed = act(mixed).to(x.dtype)
    query, key, value = torch.split(mixed, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    query = query.reshape(n_tok, -1, module.head_k_dim)
    key = key.reshape(n_tok, -1, module.head_k_dim)
    value = value.reshape(n_tok, -1, module.head_v_dim)
    beta = b.sigmoid()
    g = -module.A_log.float().exp() * torch.nn.functional.softplus(a.float() + module.dt_bias)
    core = tree_gated_delta_rule(query, key, value, g, beta, lin).to(x.dtype)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(1, n_tok, -1))


def _never_kernelize(module: torch.nn.Module) -> bool:
    """The ``kernel_condition`` of the trie-aware classes: ``kernelize`` skips these layers."""
    return False


class TrieAwareDeltaNet:
    """Mixed in front of a Gated DeltaNet class: its ``forward`` runs the trie path when a plan is present.

    Living on the class, the override survives what resets instance attributes (``kernelize`` on every
    ``train()``/``eval()`` under transformers >= 5.25); ``kernel_condition`` keeps hub kernels off it.
    """

    kernel_condition = staticmethod(_never_kernelize)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        plan = kwargs.pop("tree_plan", None) or getattr(self, _PLAN_ATTR, None)
        if plan is None:
            return super().forward(hidden_states, *args, **kwargs)  # type: ignore[misc]
        setattr(self, _TAKEN_ATTR, True)
        return packed_deltanet_forward(self, hidden_states, plan)


_TRIE_CLASSES: dict[type, type] = {}


def _make_trie_aware(module: torch.nn.Module) -> None:
    """Switch ``module`` to the trie-aware subclass of its class (one subclass per class, made once)."""
    cls = type(module)
    sub = _TRIE_CLASSES.get(cls)
    if sub is None:
        # the name keeps its "GatedDeltaNet" ending: deltanet_layout and model_support recognise it
        sub = type(f"TrieAware{cls.__name__}", (TrieAwareDeltaNet, cls), {"__module__": __name__})
        _TRIE_CLASSES[cls] = sub
    module.__class__ = sub
    setattr(module, _PLAN_ATTR, None)


def _wrap_holder(layer: torch.nn.Module, mixers: list[torch.nn.Module]) -> None:
    original = layer.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        plan = kwargs.get("tree_plan")
        if plan is None:
            return original(*args, **kwargs)
        for m in mixers:
            setattr(m, _PLAN_ATTR, plan)
            setattr(m, _TAKEN_ATTR, False)
        try:
            out = original(*args, **kwargs)
        finally:
            for m in mixers:
                setattr(m, _PLAN_ATTR, None)
        for m in mixers:
            if not getattr(m, _TAKEN_ATTR, False):
                raise RuntimeError(
                    f"the Gated DeltaNet layer {getattr(m, 'layer_idx', '?')} ({type(m).__name__}) ran a packed row "
                    "without its trie path: something set an instance-level forward on it after "
                    "install_tree_linear_attention (an accelerate hook, a hub kernel); load the model without "
                    "device_map offloading and with use_kernels=False"
                )
        return out

    layer.forward = forward


def install_tree_linear_attention(model: torch.nn.Module) -> int:
    """Make every Gated DeltaNet layer of ``model`` trie-aware (idempotent); returns how many there are.

    Layers this module does not understand are left alone: ``trainer.model_support`` refuses such
    models at construction.
    """
    holders: dict[int, tuple[torch.nn.Module, list[torch.nn.Module]]] = {}
    count = 0
    for parent in model.modules():
        for child in parent.children():
            if deltanet_layout(child) is None:
                continue
            count += 1
            if not isinstance(child, TrieAwareDeltaNet):
                _make_trie_aware(child)
                holders.setdefault(id(parent), (parent, []))[1].append(child)
    for parent, mixers in holders.values():
        if not getattr(parent, _WRAPPED_ATTR, False):
            _wrap_holder(parent, mixers)
            setattr(parent, _WRAPPED_ATTR, True)
    model._asyncgrpo_linear_layers = count  # packed_hidden_states builds the linear plan when > 0
    if count:
        logger.info("tree packing: %d Gated DeltaNet layers follow trie paths", count)
    return count


def needs_linear_plan(model: torch.nn.Module) -> bool:
    """Whether ``install_tree_linear_attention`` found linear-attention layers in ``model``."""
    return bool(getattr(model, "_asyncgrpo_linear_layers", 0))

"""Mixture-of-experts models: the router load-balancing loss of a packed row (SPEC L6, ``router_aux_loss_coef``).

The loss is the Switch-Transformer balance term the transformers MoE models define (``load_balancing_loss_func``
of Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE): over every routed token of every MoE layer, pooled,

    f_e = share of top-k assignments that go to expert e,   P_e = mean router probability of expert e,
    aux = E * sum_e f_e * P_e

with padding excluded. Only ``P`` carries a gradient (the top-k choice is discrete).

Which tokens count, and how often, in a packed row: a prefix-trie row forwards a prompt shared by G samples
once, but an unpacked batch of the same samples (padded, with an attention mask) routes it G times. We weight
each row token by the number of samples whose path holds it (``PackedRow.path_count``), so the packed value and
its gradient equal the model's own loss over the unpacked micro-batch, whatever the packing shares. Tokens on no
path (none exist in a packed row) and padding weigh 0.

Scaling (L5/L6): each process adds ``coef * aux / gradient_accumulation_steps`` for its own row, so the step's
gradient is the mean over micro-batches of ``coef * grad aux`` (DDP/FSDP then average over processes).
"""

from __future__ import annotations

from typing import Any

import torch

MOE_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def is_moe(config: Any) -> bool:
    """Whether a transformers config describes a mixture-of-experts model."""
    return any(getattr(config, k, None) for k in MOE_EXPERT_KEYS)


def resolve_router_aux_coef(config: Any, requested: float | None) -> float:
    """The coefficient the run uses: ``requested``, or the model config's ``router_aux_loss_coef`` when None.

    Raises:
        ValueError: a coefficient > 0 for a dense model, or for an MoE model whose forward cannot report its
            router logits (the loss cannot be computed); each message says what to set.
    """
    name = type(config).__name__
    if not is_moe(config):
        if requested:
            raise ValueError(
                f"router_aux_loss_coef={requested} is set but the model ({name}) is not a mixture-of-experts model: "
                "leave router_aux_loss_coef unset (None) or 0.0"
            )
        return 0.0
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if requested is None else float(requested)
    if coef > 0 and not hasattr(config, "output_router_logits"):
        raise ValueError(
            f"{name} is a mixture-of-experts model whose forward does not report router logits, so its "
            f"load-balancing loss cannot be added (router_aux_loss_coef={coef}): set router_aux_loss_coef=0.0"
        )
    return coef


def experts_per_token(config: Any) -> int:
    """Top-k of the router (``num_experts_per_tok``; 1 when the config does not say)."""
    return int(getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None) or 1)


def router_aux_loss(router_logits: list[torch.Tensor], token_weight: torch.Tensor, top_k: int) -> torch.Tensor:
    """Load-balancing loss of one forward, each token weighted (see the module docstring).

    Args:
        router_logits: per MoE layer, [T, E] router logits of the T forwarded tokens.
        token_weight: [T] how often each token counts (``PackedRow.path_count``; 0/1 = an attention mask).
        top_k: experts chosen per token.

    Returns:
        0-d fp32 tensor, differentiable through the router probabilities.
    """
    if not router_logits:
        raise ValueError("router_aux_loss needs the router logits of at least one MoE layer")
    num_experts = router_logits[0].shape[-1]
    w = token_weight.to(device=router_logits[0].device, dtype=torch.float32)
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=w.device)
    prob = torch.zeros(num_experts, dtype=torch.float32, device=w.device)
    for logits in router_logits:
        if logits.shape != (w.numel(), num_experts):
            raise ValueError(f"router logits {tuple(logits.shape)} do not match [{w.numel()} tokens, {num_experts}]")
        p = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(p.detach(), top_k, dim=-1).indices  # [T, k]
        assigned = assigned.index_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        prob = prob + (p * w[:, None]).sum(0)
    total = w.sum() * len(router_logits)
    return num_experts * torch.dot(assigned / total, prob / total)

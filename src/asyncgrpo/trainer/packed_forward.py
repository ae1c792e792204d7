"""The packed forward of a training step, through the model the Trainer prepared (FSDP2, DDP or plain).

Why not call the decoder directly: under FSDP2 the root module's parameters (embeddings,
final norm, LM head) are all-gathered by the root's forward hooks, and under DDP the
reducer is armed by the wrapper's forward. A call that bypasses the root sees sharded
DTensors ("mixed torch.Tensor and DTensor") or trains without syncing gradients. So
the step calls the root module itself with ``logits_to_keep=1`` (one position's logits,
a [1, vocab] row, instead of [tokens, vocab]) and captures the decoder's final hidden
states with a forward hook. After that forward the root keeps its parameters unsharded
until backward (FSDP2 never reshards the root after forward), so the LM head weight read
then is the full tensor, and the chunked log-probs' gradient flows into it; FSDP2's
post-backward reduce-scatters it like any other gradient.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.packing import PackedRow, TreeAttentionPlan, resolve_backend
from asyncgrpo.packing.deltanet import needs_linear_plan
from asyncgrpo.packing.linear_attention import build_linear_plan

logger = logging.getLogger(__name__)


@dataclass
class PackedForward:
    """What one row's forward gives the loss.

    Attributes:
        hidden: [T, hidden] final (normed) hidden states of the row.
        head_weight: [V, hidden] LM head weight, unsharded, in the graph (gradients reach the optimizer's copy).
        anchor: a 0-valued scalar joining every parameter of the forward to the graph: a rank whose row trains
            no token still produces a gradient (zero) for each parameter, so all ranks reduce the same set.
    """

    hidden: torch.Tensor
    head_weight: torch.Tensor
    anchor: torch.Tensor


def autocast_dtype(trainer: Any) -> torch.dtype | None:
    """The dtype the accelerator's autocast runs the step in (bf16/fp16 mixed precision); None without autocast."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(trainer.accelerator.mixed_precision))


def settle_tree_backend(trainer: Any, token_budget: int | None) -> None:
    """Set ``trainer.tree_attention_backend``: ``args.tree_attention_backend`` made concrete for ``args.device``,
    rows of up to ``token_budget`` tokens (None: not known yet) and the dtype attention runs in
    (``packing.resolve_backend``).

    The trainer settles it when built (a backend the device cannot run is refused then, not at the first step) and
    again once the run's token_budget is known (the server's max_model_len when unset): where "auto" then changes its
    choice, a compile warm-up that traced the layers with the other kernel runs again while the first groups are
    generated (``trainer/warmup.py``), not inside step 1.
    """
    args = trainer.args
    dtype = autocast_dtype(trainer) or causal_lm_of(trainer.model).dtype
    try:
        backend = resolve_backend(args.tree_attention_backend, args.device, token_budget, dtype)
    except ValueError as exc:
        raise ValueError(f"tree_attention_backend={args.tree_attention_backend!r}: {exc}") from None
    before = getattr(trainer, "tree_attention_backend", None)
    if before is not None and backend != before:
        logger.info("tree attention: %s for rows of up to %d tokens (tree_attention_backend=%r)", backend,
                    token_budget, args.tree_attention_backend)  # fmt: skip
        trainer.compile_warmed_up = False
    trainer.tree_attention_backend = backend


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The ``*ForCausalLM`` inside a DDP wrapper and/or a PEFT model."""
    inner = getattr(model, "module", model)  # DDP
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner


def packed_forward(
    model: torch.nn.Module,
    row: PackedRow,
    plan: TreeAttentionPlan,
    router_logits: list[torch.Tensor] | None = None,
) -> PackedForward:
    """Run ``row`` through ``model``'s root forward (tree attention) and return the hidden states and the head.

    Args:
        model: the module the Trainer trains (FSDP2-sharded, DDP-wrapped, PEFT or plain), switched to tree
            attention (``packing.use_tree_attention``).
        row: a packed row on the model's device.
        plan: its tree-attention plan (a linear-attention plan is added for DeltaNet hybrids).
        router_logits: a list to receive one [T, experts] tensor per MoE layer (the decoder's router logits).

    Raises:
        RuntimeError: the LM head weight is still sharded after the root forward (an FSDP setup that reshards
            the root after forward); say which setting to change.
    """
    lm = causal_lm_of(model)
    if plan.linear is None and needs_linear_plan(lm):
        plan.linear = build_linear_plan(row, row.input_ids.device)
    decoder = lm.get_decoder()
    captured: dict[str, Any] = {}

    def keep_hidden(_module: Any, _args: Any, output: Any) -> None:
        captured["hidden"] = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        captured["router"] = getattr(output, "router_logits", None)

    handle = decoder.register_forward_hook(keep_hidden)
    try:
        out = model(
            input_ids=row.input_ids[None],
            position_ids=row.position_ids[None],
            attention_mask=None,
            use_cache=False,
            logits_to_keep=1,
            tree_plan=plan,
            **({"output_router_logits": True} if router_logits is not None else {}),
        )
    finally:
        handle.remove()
    if "hidden" not in captured:
        raise RuntimeError(f"{type(lm).__name__}'s forward did not run its decoder {type(decoder).__name__}")
    weight = lm.get_output_embeddings().weight
    if hasattr(weight, "full_tensor"):
        raise RuntimeError(
            "the LM head weight is still sharded after the model's forward: FSDP2 must leave the root module "
            "unsharded between forward and backward (do not wrap the LM head in its own fully_shard unit)"
        )
    if router_logits is not None:
        if not captured["router"]:
            raise ValueError(f"{type(decoder).__name__} reported no router logits; is it a mixture-of-experts model?")
        router_logits.extend(t.reshape(-1, t.shape[-1]) for t in captured["router"])
    hidden = captured["hidden"][0]
    anchor = 0.0 * (hidden.sum() + out.logits.sum())
    return PackedForward(hidden, weight, anchor)

"""Rollout routing replay (R3, arXiv 2510.11370): route each sampled token through the experts the sampler chose.

Why: the server and the trainer run different kernels (and, asynchronously, different weights), so an MoE router
often picks a different top-k for the same token; the token's log-prob then differs for a reason no importance
weight corrects. With replay on, every MoE layer of the trainer's forward uses the sampler's expert ids
(``PackedRow.routed_experts``, from the server's ``routed_experts``) for the tokens that carry them.

The gate weights stay the trainer's own, so the router keeps learning: for replayed ids ``S`` of a token with
router logits ``z``,

    w_e = softmax(z)_e                     (e in S; models that do not renormalise, e.g. OLMoE)
    w_e = softmax(z)_e / sum_{j in S} softmax(z)_j = exp(z_e) / sum_{j in S} exp(z_j)   (norm_topk_prob models)

which is the model's own weighting evaluated on ``S`` (the second line is R3's softmax restricted to the
replayed experts). Which of the two a router uses is read off its first forward: its own weights must equal one
of them for its own top-k, or replay refuses the model. Tokens without a sampler routing (rows of -1: the last
sampled token, tool results the episode ended on) keep the router's own choice. The load-balancing loss
(``trainer/moe.py``) reads the router logits, which replay leaves unchanged.

The hooks stay on the routers for the whole run, and the routing of a micro-batch stays set from before its
forward until after its backward: activation checkpointing re-runs the forward inside backward and must route
the same way. Counting (the ``moe/*`` metrics) happens only in the first forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from asyncgrpo.models.moe_routers import router_modules

_ROUNDING_ULPS = 4  # own weights vs the formula: both float32 softmax, then rounded to the router's dtype


class RouterReplay:
    """Forward hooks on every MoE router: replay (``replay=True``) and/or count sampler/trainer routing mismatch.

    Args:
        model: the trained model (plain, PEFT, DDP or FSDP2-wrapped: routers are found by module name).
        replay: route sampler-routed tokens through the sampler's experts; False only counts (diagnosis).

    Raises:
        ValueError: the model has no top-k router (not a mixture-of-experts model replay supports).
    """

    def __init__(self, model: nn.Module, replay: bool) -> None:
        self.replay = replay
        self.routers = router_modules(model)
        if not self.routers:
            raise ValueError(
                f"router_replay / vllm_return_routed_experts need a mixture-of-experts model with top-k routers "
                f"(layers.<i>.mlp.gate); {type(model).__name__} has none: set router_replay=False and leave "
                "vllm_return_routed_experts unset"
            )
        self.top_k = int(self.routers[0][1].top_k)
        self._routing: torch.Tensor | None = None  # [N, layers, top_k] int64 for the current forward
        self._counting = False
        self._normalise: dict[int, bool] = {}  # layer -> renormalises its top-k weights (read off its first forward)
        self._differ: dict[str, torch.Tensor] = {}  # "used"/"router" -> [layers] tokens whose set differs
        self._routed: torch.Tensor | None = None  # [layers] sampler-routed tokens counted
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in self.routers]

    # ------------------------------------------------------------------ per micro-batch
    def begin(self, routing: torch.Tensor | None) -> None:
        """Use ``routing`` ([N, layers, top_k], -1 rows: none; None: no sampler routing) for the next forward
        and its backward's recomputation; count this forward's mismatch."""
        if routing is not None:
            last = self.routers[-1][0]
            if routing.ndim != 3 or routing.shape[2] != self.top_k or routing.shape[1] <= last:
                raise ValueError(
                    f"the sampler's routed_experts are {tuple(routing.shape)} but the trained model routes "
                    f"{self.top_k} experts per token in {last + 1} layers: the server runs another model"
                )
            routing = routing.long()
        self._routing = routing
        self._counting = routing is not None

    def end_forward(self) -> None:
        """The forward is done: a recomputation in backward routes the same way but is not counted again."""
        self._counting = False

    def end(self) -> None:
        """After backward: forget the micro-batch's routing."""
        self._routing = None
        self._counting = False

    def take_metrics(self) -> dict[str, float]:
        """``moe/routing_mismatch/{mean,max}`` and ``moe/router_disagreement/{mean,max}`` since the last call:
        per layer, the share of sampler-routed tokens whose top-k set differs from the sampler's (experts used in
        the forward / the trainer router's own choice), then the mean and max over layers. Empty without tokens."""
        routed = self._routed
        self._routed = None
        differ, self._differ = self._differ, {}
        if routed is None or not bool((routed > 0).any()):  # one CPU-GPU sync per logging window
            return {}
        keep = routed > 0
        out: dict[str, float] = {}
        for key, name in (("used", "moe/routing_mismatch"), ("router", "moe/router_disagreement")):
            share = (differ[key][keep] / routed[keep]).float()
            out[f"{name}/mean"] = float(share.mean())
            out[f"{name}/max"] = float(share.max())
        return out

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ the hook
    def _hook(self, layer: int):
        def route(module: nn.Module, _args: Any, output: Any) -> Any:
            if self._routing is None:
                return None
            logits, weights, own = output[0], output[1], output[-1]
            ids = self._routing[:, layer, :].to(own.device)  # [N, k]
            if ids.shape[0] != own.shape[0]:
                raise RuntimeError(
                    f"layer {layer}'s router saw {own.shape[0]} tokens but the row's routing has {ids.shape[0]}"
                )
            has = ids[:, 0] >= 0
            chosen = torch.where(has[:, None], ids, own) if self.replay else own
            if self._counting:
                self._count(layer, has, ids, own, chosen)
            if not self.replay:
                return None
            if layer not in self._normalise:  # no graph: a checkpointed recompute must save what the forward saved
                with torch.no_grad():
                    probs = torch.softmax(logits.detach().float(), dim=-1)
                    self._normalise[layer] = _weighting_rule(module, probs, own, weights, layer)
            w = torch.softmax(logits.float(), dim=-1).gather(1, chosen)  # [N, k]
            if self._normalise[layer]:
                w = w / w.sum(dim=-1, keepdim=True)
            return (*output[:-2], w.to(weights.dtype), chosen)

        return route

    def _count(self, layer: int, has: torch.Tensor, ids: torch.Tensor, own: torch.Tensor, used: torch.Tensor) -> None:
        n_layers = self._routing.shape[1]  # type: ignore[union-attr]
        if self._routed is None:
            self._routed = torch.zeros(n_layers, dtype=torch.long, device=has.device)
            self._differ = {k: torch.zeros(n_layers, dtype=torch.long, device=has.device) for k in ("used", "router")}
        sampler = ids.sort(dim=-1).values
        self._routed[layer] += has.sum()
        for key, mine in (("used", used), ("router", own)):
            differs = (mine.sort(dim=-1).values != sampler).any(dim=-1) & has
            self._differ[key][layer] += differs.sum()


def _weighting_rule(module: nn.Module, probs: torch.Tensor, own: torch.Tensor, weights: torch.Tensor, layer: int):
    """Whether the router renormalises its top-k weights, checked against what it returned for its own top-k.

    Raises:
        ValueError: neither rule reproduces its weights (a router replay does not know how to reweigh).
    """
    picked = probs.gather(1, own)
    got = weights.float()
    tol = max(1e-6, _ROUNDING_ULPS * torch.finfo(weights.dtype).eps)
    for normalise in (bool(getattr(module, "norm_topk_prob", False)), not getattr(module, "norm_topk_prob", False)):
        w = picked / picked.sum(dim=-1, keepdim=True) if normalise else picked
        if torch.allclose(w, got, rtol=tol, atol=tol):
            return normalise
    raise ValueError(
        f"router replay: {type(module).__name__} (layer {layer}) weighs its experts neither by softmax probability "
        "nor by renormalised softmax probability; this router is not supported: set router_replay=False"
    )


def build_router_replay(model: nn.Module, replay: bool, wants_routing: bool) -> RouterReplay | None:
    """The run's :class:`RouterReplay`: replaying under ``router_replay``, counting only when routing is fetched for
    the diagnosis, None when the samples carry no routing."""
    if not wants_routing:
        return None
    return RouterReplay(model, replay=replay)


def check_server_routing(wanted: bool, server_returns: bool, base_urls: list[str]) -> None:
    """Refuse a run that replays (or diagnoses) routing against servers that do not return it.

    Raises:
        RuntimeError: says which server flag to add.
    """
    if wanted and not server_returns:
        raise RuntimeError(
            f"router_replay / vllm_return_routed_experts need each token's routed experts, but the generation "
            f"server at {', '.join(base_urls)} does not return them: start it with --enable-return-routed-experts "
            "(vLLM >= 0.32 and the embedded server), or set router_replay=False"
        )

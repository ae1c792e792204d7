"""Config fields of mixture-of-experts routing replay: the trainer routes sampled tokens as the sampler did.

Names: ``router_replay`` follows the RL frameworks that ship rollout routing replay ("R3", arXiv 2510.11370) as
one switch: NeMo RL's ``policy.router_replay.enabled``, verl's ``router_replay`` section (whose ``mode: R3`` is
the only mode here: verl's ``R2`` replays the trainer's own old-policy routing, from a second forward this
trainer never runs), Megatron's ``moe_enable_routing_replay``. ``vllm_return_routed_experts`` follows TRL's
``vllm_*`` prefix for what the generation server is asked for, and vLLM 0.33's ``--enable-return-routed-experts``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class MoeReplayFields:
    router_replay: bool = field(
        default=False,
        metadata={
            "help": "Mixture-of-experts rollout routing replay: every MoE layer routes each token (prompt and "
            "sampled) through the experts the server's routers chose for it; the server must run with "
            "--enable-return-routed-experts. Gate weights stay the trainer's softmax over those experts, so the "
            "router still learns."
        },
    )
    vllm_return_routed_experts: bool | None = field(
        default=None,
        metadata={
            "help": "Ask the server for each token's routed experts. None: only with router_replay; True without "
            "router_replay fetches them for the moe/router_disagreement diagnosis only."
        },
    )

    @property
    def wants_routed_experts(self) -> bool:
        """Whether rollouts request (and samples carry) the sampler's routing."""
        if self.vllm_return_routed_experts is None:
            return bool(self.router_replay)
        return bool(self.vllm_return_routed_experts)


def moe_replay_problems(cfg: Any) -> list[str]:
    """Invalid combinations of the routing-replay fields, each with its fix."""
    p: list[str] = []
    if cfg.router_replay and cfg.vllm_return_routed_experts is False:
        p.append("router_replay replays the server's routing: leave vllm_return_routed_experts None or True")
    if cfg.wants_routed_experts and cfg.compile_decoder_layers:
        p.append(
            "router replay hooks the MoE routers inside the decoder layers, which compile_decoder_layers compiles: "
            "set compile_decoder_layers=False (or router_replay=False)"
        )
    return p

"""Config fields of mixture-of-experts routing replay (R3): the trainer routes sampled tokens as the sampler did.

Names: ``router_replay_mode`` and its values follow verl's ``actor.router_replay.mode`` (``disabled``/``R3``;
verl's ``R2``, replaying the trainer's own old-policy routing, needs a second forward this trainer never runs);
``vllm_return_routed_experts`` follows TRL's ``vllm_*`` prefix for what the generation server is asked for, and
vLLM 0.33's ``--enable-return-routed-experts`` server flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

REPLAY_MODES = ("disabled", "R3")


@dataclass
class MoeReplayFields:
    router_replay_mode: str = field(
        default="disabled",
        metadata={
            "help": "Mixture-of-experts routing replay. 'R3' routes every sampled token (and its prompt) through "
            "the experts the server's routers chose (the server must run with --enable-return-routed-experts); "
            "gate weights stay the trainer's softmax over those experts, so the router still learns. "
            "'disabled': the trainer routes itself.",
            "choices": list(REPLAY_MODES),
        },
    )
    vllm_return_routed_experts: bool | None = field(
        default=None,
        metadata={
            "help": "Ask the server for each token's routed experts. None: only with router_replay_mode='R3'; "
            "True with replay disabled fetches them for the moe/router_disagreement diagnosis only."
        },
    )

    @property
    def wants_routed_experts(self) -> bool:
        """Whether rollouts request (and samples carry) the sampler's routing."""
        if self.vllm_return_routed_experts is None:
            return self.router_replay_mode == "R3"
        return bool(self.vllm_return_routed_experts)


def moe_replay_problems(cfg: Any) -> list[str]:
    """Invalid values or combinations of the routing-replay fields, each with its fix."""
    p: list[str] = []
    if cfg.router_replay_mode not in REPLAY_MODES:
        p.append(f"router_replay_mode={cfg.router_replay_mode!r}: choose one of {REPLAY_MODES}")
    if cfg.router_replay_mode == "R3" and cfg.vllm_return_routed_experts is False:
        p.append("router_replay_mode='R3' replays the server's routing: leave vllm_return_routed_experts None or True")
    if cfg.wants_routed_experts and cfg.compile_decoder_layers:
        p.append(
            "router replay hooks the MoE routers inside the decoder layers, which compile_decoder_layers compiles: "
            "set compile_decoder_layers=False (or router_replay_mode='disabled')"
        )
    return p

"""The requester: one generation request of the rollout loop, its server, model and seed, and its answer as a turn.

Which server and which policy version a request belongs to is its group's, a ``GroupRoute`` passed to every
method that needs it (X5: a group and all its turns stay on one server; T6: under adapter sync a rollout names the
adapter of the version its group started under). The hooks (``generate_one_turn``) take no route argument, so the
group's task enters its route once (``enter_group``) and the loop reads it back with ``current_route``: the
tasks of the group's rollouts inherit it, and nothing else in the package sets it.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.client.pool import ServerPool
from asyncgrpo.client.server_rules import is_length_error
from asyncgrpo.errors import ServerError
from asyncgrpo.rollout import routing
from asyncgrpo.rollout.records import SampledTurn
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.types import Rollout, TurnRecord

logger = logging.getLogger(__name__)

SEED_MODULUS = 2**31 - 1  # request seeds stay in int32 range for every server


@dataclass(frozen=True)
class GroupRoute:
    """Where a group's requests go: its server (X5) and the policy version it started under (T6)."""

    server: int
    version: int


# The route of the group whose task runs now; set once in the group's task, inherited by its rollouts' tasks.
_ROUTE: contextvars.ContextVar[GroupRoute | None] = contextvars.ContextVar("asyncgrpo_group_route", default=None)


def enter_group(route: GroupRoute) -> None:
    """Make ``route`` the current task's (a group's task calls it before it starts its rollouts)."""
    _ROUTE.set(route)


def current_route() -> GroupRoute | None:
    """The route of the group this task belongs to; None outside a group."""
    return _ROUTE.get()


def single_turn_rollout(turn: TurnRecord, tokenizer: Any) -> Rollout:
    """A one-turn rollout: the turn's output decoded as the assistant's message."""
    text = tokenizer.decode(turn.output_ids, skip_special_tokens=True)
    return Rollout(completion=[{"role": "assistant", "content": text}], completion_ids=turn.output_ids, turns=[turn])


class Requester:
    """Sends requests for the rollout loop and turns answers into turns.

    Args:
        settings: the run's settings (sampling, seed, ``num_generations``, adapter sync).
        pool: the generation servers.
        policy_version: the trainer's current policy version (a shared counter).
        dropped_servers: the bit mask of servers the trainer dropped.
    """

    def __init__(
        self,
        settings: RolloutSettings,
        pool: ServerPool,
        policy_version: Callable[[], int],
        dropped_servers: Callable[[], int] = lambda: 0,
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.policy_version = policy_version
        self.dropped_servers = dropped_servers
        self.seed_counter = 0
        self.generated_tokens = 0  # the G5 poller's tokens/s

    async def sample(self, prompt_ids: list[int], params: dict[str, Any], route: GroupRoute | None) -> list[Any]:
        """One request (``params["n"]`` choices, default 1) to the route's server; a 400 becomes an error that says
        what to change."""
        self.pool.drop_flagged(self.dropped_servers())
        try:
            results = await self._request(prompt_ids, params, self.request_model(route), route)
        except ServerError as e:
            if e.status == 400 and is_length_error(e.message):
                raise ValueError(
                    f"the generation server rejected a prompt of {len(prompt_ids)} tokens: {e}. Shorten the prompts "
                    f"or start the server with a larger --max-model-len (now {self.settings.sampling.max_model_len})"
                ) from e
            if e.status == 400:
                raise ValueError(f"the generation server rejected a request (sampling settings {params}): {e}") from e
            raise
        self.generated_tokens += sum(len(r.token_ids) for r in results)
        return results

    def turn(self, prompt_ids: list[int], res: Any) -> TurnRecord:
        """One answer as a turn; its finish reason rides on the record to the group's ``completions/*`` metrics."""
        sampling = self.settings.sampling
        return SampledTurn(
            prompt_ids=list(prompt_ids),
            output_ids=res.token_ids,
            output_log_probs=res.logprobs,
            output_sampling_mask=res.sampling_mask if sampling.wants_masks else None,
            output_sampler_logprobs=res.top_logprobs if sampling.num_sampler_logprobs is not None else None,
            finish_reason=res.finish_reason,
            **(routing.turn_routing(prompt_ids, res) if sampling.routed_experts else {}),
        )

    def request_model(self, route: GroupRoute | None) -> str:
        """The ``model`` of a request: the served model, or under adapter sync (T6) the LoRA adapter of the policy
        version the route's group started under (it finishes under that policy); outside a group the current one."""
        return self.settings.request_model(self.policy_version() if route is None else route.version)

    def server_index(self, route: GroupRoute | None) -> int:
        """The route's server (X5); outside a group the least loaded one."""
        return self.pool.least_loaded() if route is None else route.server

    def client(self, route: GroupRoute | None) -> AsyncServerClient:
        """The client of the route's server (a live one if it died)."""
        return self.pool.client(None if route is None else route.server)

    async def _request(self, prompt_ids: list[int], params: dict[str, Any], model: str, route: GroupRoute | None
                       ) -> Any:  # fmt: skip
        """One request to the route's server naming ``model``; its ``n`` results (one unless ``n`` > 1)."""
        generate = self.settings.sampling.use_generate_endpoint
        server = self.server_index(route)

        def call(m: str) -> Any:
            return self.pool.call(server, lambda c: (c.generate_n if generate else c.complete_n)(
                prompt_ids, params, model=m))  # fmt: skip

        try:
            return await call(model)
        except ServerError as e:
            if e.status != 404 or self.settings.lora_name is None:
                raise
            if await self._register_again(model, server):  # the server restarted and lost the adapters
                return await call(model)
            current = self.settings.request_model(self.policy_version())
            if model == current:
                raise
            # The group's adapter left the staleness window: its samples will be dropped as stale anyway.
            return await call(current)

    async def _register_again(self, name: str, server: int) -> bool:
        """Adapter sync: a server that restarted lost every adapter, so a rollout registers its own again from
        the run's adapter directory (while it is still there: retired versions are deleted). True when the server
        has it now (another rollout may have registered it first)."""
        if self.settings.lora_dir is None:
            return False
        path = Path(self.settings.lora_dir) / name
        if not (path / "adapter_config.json").is_file():
            return False
        try:
            await self.pool.call(server, lambda c: c.load_lora_adapter(name, str(path.resolve())))
        except ServerError as e:
            if e.status != 400 or "already" not in e.message:
                logger.warning("could not register LoRA adapter %s again: %s", name, e)
                return False
        logger.warning("the server had lost LoRA adapter %s (did it restart?): registered it again from %s", name, path)
        return True

    def next_seed(self) -> int:
        """A seed unique per request (G7): data-parallel engines never decode identical text for one prompt."""
        self.seed_counter += 1
        return (self.settings.seed * 1_000_003 + self.seed_counter) % SEED_MODULUS

    def group_seed(self, group_id: int) -> int:
        """The seed of a group sent as one request: its G choices get seeds seed .. seed+G-1 (the server adds the
        choice index), the block ``group_id`` owns. Fixed by the group's place in the run, not by when its request
        goes out, so a run's samples do not depend on timing; unique per choice over the run (G7)."""
        G = self.settings.num_generations
        return (self.settings.seed * 1_000_003 + group_id * G) % (SEED_MODULUS - G) + 1  # seed+G-1 < 2**31 - 1

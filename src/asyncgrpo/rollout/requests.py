"""One generation request of the rollout loop: its server, model and seed, sending it, and its answer as a turn.

``RequestMixin`` is a base of ``AsyncRolloutLoop`` (``rollout/loop.py``); the hooks there call it. Which server
and which policy version a request belongs to is its group's: the group's task sets two context variables that
the tasks of its rollouts inherit (X5: a group and all its turns stay on one server; T6: under adapter sync a
rollout names the adapter of the version its group started under), so no hook has to pass them along.
"""

from __future__ import annotations

import contextvars
import logging
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
# The policy version a group started under; its rollouts' tasks inherit it (adapter sync: the adapter they name).
_GROUP_VERSION: contextvars.ContextVar[int | None] = contextvars.ContextVar("asyncgrpo_group_version", default=None)
# The server a group was routed to (X5); set in the group's task, inherited by its rollouts' tasks.
_GROUP_SERVER: contextvars.ContextVar[int | None] = contextvars.ContextVar("asyncgrpo_group_server", default=None)


class RequestMixin:
    """Sending one request and reading its answer; the state it reads is set up by ``run`` (``production.py``)."""

    settings: RolloutSettings
    tokenizer: Any
    channels: Any
    pool: ServerPool
    _seed_counter: int
    _generated_tokens: int

    async def _sample(self, prompt_ids: list[int], params: dict[str, Any]) -> list[Any]:
        """One request (``params["n"]`` choices, default 1) to this group's server; a 400 becomes an error that
        says what to change."""
        self.pool.drop_flagged(self.channels.dropped_server_mask())
        try:
            results = await self._request(prompt_ids, params, self.request_model())
        except ServerError as e:
            if e.status == 400 and is_length_error(e.message):
                raise ValueError(
                    f"the generation server rejected a prompt of {len(prompt_ids)} tokens: {e}. Shorten the prompts "
                    f"or start the server with a larger --max-model-len (now {self.settings.sampling.max_model_len})"
                ) from e
            if e.status == 400:
                raise ValueError(f"the generation server rejected a request (sampling settings {params}): {e}") from e
            raise
        self._generated_tokens += sum(len(r.token_ids) for r in results)
        return results

    def _turn(self, prompt_ids: list[int], res: Any) -> TurnRecord:
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

    def _single_turn_rollout(self, turn: TurnRecord) -> Rollout:
        text = self.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
        return Rollout(
            completion=[{"role": "assistant", "content": text}], completion_ids=turn.output_ids, turns=[turn]
        )

    def request_model(self) -> str:
        """The ``model`` of this rollout's requests: the served model, or under adapter sync (T6) the LoRA adapter
        of the policy version the rollout's group started under (it finishes under that policy)."""
        version = _GROUP_VERSION.get()
        return self.settings.request_model(self.channels.policy_version.value if version is None else version)

    async def _request(self, prompt_ids: list[int], params: dict[str, Any], model: str) -> Any:
        """One request to this rollout's server (X5) naming ``model``; its ``n`` results (one unless ``n`` > 1)."""
        generate = self.settings.sampling.use_generate_endpoint

        def call(m: str) -> Any:
            return self.pool.call(self.server_index, lambda c: (c.generate_n if generate else c.complete_n)(
                prompt_ids, params, model=m))  # fmt: skip

        try:
            return await call(model)
        except ServerError as e:
            if e.status != 404 or self.settings.lora_name is None:
                raise
            if await self._register_again(model):  # the server restarted and lost the adapters
                return await call(model)
            current = self.settings.request_model(self.channels.policy_version.value)
            if model == current:
                raise
            # The group's adapter left the staleness window: its samples will be dropped as stale anyway.
            return await call(current)

    async def _register_again(self, name: str) -> bool:
        """Adapter sync: a server that restarted lost every adapter, so a rollout registers its own again from
        the run's adapter directory (while it is still there: retired versions are deleted). True when the server
        has it now (another rollout may have registered it first)."""
        if self.settings.lora_dir is None:
            return False
        path = Path(self.settings.lora_dir) / name
        if not (path / "adapter_config.json").is_file():
            return False
        try:
            await self.pool.call(self.server_index, lambda c: c.load_lora_adapter(name, str(path.resolve())))
        except ServerError as e:
            if e.status != 400 or "already" not in e.message:
                logger.warning("could not register LoRA adapter %s again: %s", name, e)
                return False
        logger.warning("the server had lost LoRA adapter %s (did it restart?): registered it again from %s", name, path)
        return True

    @property
    def server_index(self) -> int:
        """The server this rollout's group was routed to (X5: a group and all its turns stay on one server)."""
        i = _GROUP_SERVER.get()
        return self.pool.least_loaded() if i is None else i

    @property
    def client(self) -> AsyncServerClient:
        """The client of this rollout's server (a live one if it died); hooks may call it directly."""
        return self.pool.client(_GROUP_SERVER.get())

    def _next_seed(self) -> int:
        # Unique per request (G7): data-parallel engines never decode identical text for one prompt.
        self._seed_counter += 1
        return (self.settings.seed * 1_000_003 + self._seed_counter) % SEED_MODULUS

    def _group_seed(self, group_id: int) -> int:
        """The seed of a group sent as one request: its G choices get seeds seed .. seed+G-1 (the server adds the
        choice index), the block ``group_id`` owns. Fixed by the group's place in the run, not by when its request
        goes out, so a run's samples do not depend on timing; unique per choice over the run (G7)."""
        G = self.settings.num_generations
        return (self.settings.seed * 1_000_003 + group_id * G) % (SEED_MODULUS - G) + 1  # seed+G-1 < 2**31 - 1

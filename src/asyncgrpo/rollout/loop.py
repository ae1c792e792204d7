"""``AsyncRolloutLoop``: the user's extension point of the rollout worker (T8), with its hooks.

Runs inside the spawned worker process (``rollout/worker.py``). For each prompt it generates ``num_generations``
rollouts, scores the group once all are complete, computes advantages, drops zero-std groups and queues the rest
as training sequences. This file holds the hooks, the helpers they use and ``run``, which wires the components
the loop holds (docs/design.md, "The rollout side"): a prompt source (``prompt_order.py``), the requester
(``requests.py``: server, model, seed, answer), the concurrency slots (``admission.py``), the group runner
(``group_run.py``: one group's rollouts, rewards and queueing, scored by the pure ``scoring.py``) and the group
producer (``production.py``: groups in flight under the staleness admission G3, failures, the end of data).

Subclass and override the hooks (``filter_prompt``, ``generate_one``, ``generate_one_turn``,
``compute_advantages``, ``setup``, ``close``), then set the subclass as the trainer subclass's ``loop_cls``. The
subclass must be defined at module level (the worker re-imports it after the spawn). Hooks may use
``self.render_prompt``, ``self.render_conversation``, ``self.client`` (this group's server), ``self.settings``,
``self.tokenizer`` and ``self.channels.put_metric``.

The loop reads the run only through ``self.settings``, a frozen ``RolloutSettings`` the trainer built once
(``rollout/settings.py``). Knobs of your own reach the hooks two ways: fields your ``AsyncGRPOConfig`` subclass
adds are copied into ``settings.extra`` and read as ``self.config.<field>``; anything else, override
``AsyncGRPOTrainer.rollout_settings`` and return ``dataclasses.replace(settings, extra={**settings.extra, ...})``.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from asyncgrpo.client.answer_parse import AnswerParsers
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.client.pool import ServerPool
from asyncgrpo.models.vlm import check_no_images
from asyncgrpo.rollout import routing
from asyncgrpo.rollout.admission import ConcurrencyCap, RolloutSlots, StalenessAdmission
from asyncgrpo.rollout.advantages import group_advantages
from asyncgrpo.rollout.agents.episode import AgentRuntime
from asyncgrpo.rollout.agents.tool_loop import ToolLoopSettings, run_tool_loop
from asyncgrpo.rollout.group_run import GroupRunner
from asyncgrpo.rollout.pool_source import PoolPromptSource
from asyncgrpo.rollout.production import GroupOutcome, GroupProducer
from asyncgrpo.rollout.prompt_order import PromptItem, PromptOrder, PromptSource
from asyncgrpo.rollout.records import ToolLoopRollout
from asyncgrpo.rollout.requests import Requester, current_route, single_turn_rollout
from asyncgrpo.rollout.server_poll import poll_server_metrics
from asyncgrpo.rollout.settings import ConfigView, RolloutSettings
from asyncgrpo.types import Rollout, RolloutGroup, TurnRecord

RENDER_CACHE_SIZE = 512  # rendered prompts kept (a group's G rollouts share one)


class AsyncRolloutLoop:
    """Generates and scores the rollouts of an ``AsyncGRPOTrainer`` run (default: single-turn GRPO).

    Args:
        settings: the run as plain values, built once by the trainer (``AsyncGRPOTrainer.rollout_settings``).
        dataset: rows with a conversational ``prompt`` column; other columns go to the reward functions.
        reward_funcs: sync or async callables (module-level: they are pickled into this process).
        processing_class: the tokenizer (its chat template renders prompts).
        tools: the trainer's tools (module-level functions), handed to ``generate_one``.
        environment_factory: name -> environment factory (``{"": factory}`` for a single one), or None; each
            rollout gets an instance's public methods as extra tools (A4).
    """

    # A single-turn group goes out as one request for its G completions (see _group_as_one_request); a subclass
    # sets this False to send G requests instead.
    group_requests: bool = True

    def __init__(
        self,
        settings: RolloutSettings,
        dataset: Any,
        reward_funcs: list[Any],
        processing_class: Any,
        *,
        tools: list[Any] | None = None,
        environment_factory: dict[str, Any] | None = None,
    ) -> None:
        if not isinstance(settings, RolloutSettings):
            raise TypeError(
                f"settings must be a RolloutSettings, got {type(settings).__name__}; the trainer builds it with "
                "AsyncGRPOTrainer.rollout_settings"
            )
        self.settings = settings
        self.dataset = dataset
        self.reward_funcs = list(reward_funcs)
        self.tokenizer = processing_class
        self.tools = list(tools or [])
        self.environment_factory = environment_factory

    @property
    def config(self) -> ConfigView:
        """The fields an ``AsyncGRPOConfig`` subclass adds (``settings.extra``), as attributes."""
        return ConfigView(self.settings.extra)

    # ------------------------------------------------------------------ wiring

    async def run(self, channels: Any) -> None:
        """Entry point called by the worker process; returns when ``channels.stop`` is set or data runs out.

        Builds the components the loop holds (``components``), runs the producer under the staleness admission,
        and closes them again."""
        st = self.settings
        self.admission = StalenessAdmission(st.max_staleness, st.initial_tokens_per_step)
        async with self.components(channels) as runner:
            poller = asyncio.create_task(poll_server_metrics(st.sampling.has_metrics, self.pool, self.slots.cap,
                                                             channels, lambda: self.requester.generated_tokens))  # fmt: skip
            try:
                source = self.prompt_source()
                feedback = getattr(source, "on_group", None)  # a source that learns from results (prompt pools)

                async def run_group(item: PromptItem, group_id: int) -> GroupOutcome:
                    outcome = await runner.run(item, group_id)
                    if feedback is not None:
                        feedback(item.flat_index, outcome.rewards)
                    return outcome

                def accept(item: PromptItem) -> bool:
                    taken = self.filter_prompt(item.row_index, item.row, item.epoch)
                    if not taken and feedback is not None:
                        feedback(item.flat_index, None)  # nothing generated: the prompt is no longer in flight
                    return taken

                producer = GroupProducer(source, channels, self.admission, run_group=run_group, accept=accept,
                                         sync_rollouts=st.sync_rollouts)  # fmt: skip
                await producer.run()
            finally:
                poller.cancel()

    @contextlib.asynccontextmanager
    async def components(self, channels: Any) -> AsyncIterator[GroupRunner]:
        """The loop's components, from the inside out, and the group runner over them; ``setup`` runs after they
        are built and ``close`` before they are closed.

        ``run`` (training) drives the runner with the group producer and its staleness admission; a held-out
        evaluation of an agent set (``tasks/agent_eval.py``) drives it over the set's rows with channels of its own,
        so both run each episode through the same runner, tool loop and environments."""
        self.channels = channels
        st = self.settings
        # Sync tools, reset/get_reward and sync reward functions share this pool: one thread per concurrent
        # rollout (G6 in docs/spec.md); threads start lazily, so a large cap costs nothing until used.
        self._executor = ThreadPoolExecutor(max_workers=st.max_concurrent_rollouts)
        self.agents = AgentRuntime(self.tools, self.environment_factory, self._executor, channels.put_metric)
        parsers = AnswerParsers(st.answer_parse_processes)
        self.pool = ServerPool(st.sampling.urls, timeout=st.request_timeout_s,
                               max_connections=st.max_concurrent_rollouts, retry_for_s=st.retry_for_s,
                               answer_parsers=parsers)  # fmt: skip
        self.requester = Requester(st, self.pool, lambda: channels.policy_version.value, channels.dropped_server_mask)
        cap = ConcurrencyCap(st.max_concurrent_rollouts, st.sampling.kv_cache_tokens, st.sampling.max_model_len,
                             has_metrics=st.sampling.has_metrics)  # fmt: skip
        self.slots = RolloutSlots(cap, channels.put_metric)
        parsers.start()  # in the background: answers are parsed inline until a helper is up
        try:
            await self.setup()
            try:
                # After setup: it may change what the runner's choices and the prompt source read (the dataset).
                yield GroupRunner(self, st, self.requester, self.slots, self.agents, self.pool, channels,
                                  reward_funcs=self.reward_funcs, executor=self._executor, tokenizer=self.tokenizer,
                                  has_environments=self.environment_factory is not None,
                                  one_request=self._group_as_one_request())  # fmt: skip
            finally:
                await self.close()
        finally:
            await self.pool.close()
            await parsers.close()
            self._executor.shutdown(wait=False, cancel_futures=True)

    def prompt_source(self) -> PromptSource:
        """Where the prompts come from (default: epochs over ``dataset``, resumed at the checkpoint's first unsettled
        prompt; with ``prompt_pools``, draws by difficulty, ``pool_source.py``). A subclass may return another
        ``PromptSource`` (a curriculum); one with ``on_group(flat_index, rewards)`` is told every finished group."""
        st = self.settings
        if st.prompt_pools is not None:
            return PoolPromptSource(self.dataset, st.prompt_pools, st.dataset_start_index, st.num_epochs,
                                    st.skip_indices, st.pool_state, st.pass_threshold)  # fmt: skip
        return PromptOrder(self.dataset, st.dataset_start_index, st.num_epochs, st.skip_indices)

    # ------------------------------------------------------------------ hooks

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Whether to generate for this prompt (rejected prompts count as consumed for the epoch)."""
        return True

    async def setup(self) -> None:
        """Create resources the other hooks need, on the loop's event loop (default: nothing)."""

    async def close(self) -> None:
        """Release what ``setup`` created; runs when the loop stops, also on failure (default: nothing)."""

    async def generate_one(self, prompt: list[dict[str, Any]], tools: list[Any], group_id: int = 0) -> Rollout:
        """One whole rollout for ``prompt``: the multi-turn tool loop when there are tools, else a single turn."""
        if tools:
            rollout, stats = await run_tool_loop(
                prompt,
                tools,
                render=self.render_conversation,
                generate_turn=self.generate_one_turn,
                decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                executor=self._executor,
                settings=ToolLoopSettings(
                    self.settings.max_tool_calling_iterations, self.settings.sampling.max_model_len
                ),
            )
            return ToolLoopRollout.of(rollout, stats)  # the stats: the group's tools/* metrics
        return single_turn_rollout(await self.generate_one_turn(self.render_prompt(prompt)), self.tokenizer)

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with the run's sampling settings. The turn carries the server's ``finish_reason``;
        a rollout's last one decides whether it counts as clipped (``completions/*`` metrics)."""
        params = self.settings.sampling.request_params(len(prompt_ids), seed=self.requester.next_seed())
        if self.settings.sampling.routed_experts:  # only the rows this rollout does not hold yet (rollout/routing.py)
            params["routed_experts_prompt_start"] = routing.prompt_start(prompt_ids)
        (res,) = await self._sample(prompt_ids, params)
        return self.requester.turn(prompt_ids, res)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: rewards centred (and divided by the std unless ``scale_rewards`` is off)
        within the group; 0 for unscored rollouts."""
        return group_advantages(group.rewards, scale=self.settings.scale_rewards)

    # ------------------------------------------------------------------ helpers

    @property
    def client(self) -> AsyncServerClient:
        """The client of this rollout's server (X5: its group's; a live one if it died); hooks may call it directly."""
        return self.requester.client(current_route())

    def request_model(self) -> str:
        """The ``model`` of this rollout's requests: the served model, or under adapter sync (T6) the adapter of the
        policy version its group started under."""
        return self.requester.request_model(current_route())

    async def _sample(self, prompt_ids: list[int], params: dict[str, Any]) -> list[Any]:
        """One request (``params["n"]`` choices, default 1) to this group's server: every request of the loop
        passes here (a subclass may watch them)."""
        return await self.requester.sample(prompt_ids, params, current_route())

    def render_prompt(self, prompt: list[dict[str, Any]]) -> list[int]:
        """Token ids of a dataset prompt. The G rollouts of a group render the same prompt, and a chat template costs
        about half a millisecond on the event loop, so renderings are kept for the last few hundred prompts."""
        rendered: dict[str, list[int]] = self.__dict__.setdefault("_rendered", {})  # repr(prompt) -> token ids
        key = repr(prompt)
        ids = rendered.get(key)
        if ids is None:
            ids = self.render_conversation(prompt, None)
            if len(rendered) >= RENDER_CACHE_SIZE:
                del rendered[next(iter(rendered))]  # the oldest
            rendered[key] = ids
        return list(ids)

    def render_conversation(
        self, messages: list[dict[str, Any]], tool_schemas: list[dict[str, Any]] | None
    ) -> list[int]:
        """Token ids of the whole conversation with the generation prompt (the tools' schemas shown if any)."""
        check_no_images(messages, "a conversation to render")  # environments and tools may return images too
        kwargs = dict(self.settings.chat_template_kwargs)
        if tool_schemas:
            kwargs["tools"] = tool_schemas
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def _group_as_one_request(self) -> bool:
        """Whether a group's G rollouts go out as one request with ``n`` = G: single-turn groups (no tools, no
        environments) whose loop keeps the default ``generate_one`` and ``generate_one_turn`` (an override owns
        its requests), when ``max_concurrent_rollouts`` holds a group, unless ``group_requests`` is False.

        The completions are those of G single requests: the server seeds choice i with seed + i (vLLM's parallel
        sampling; the embedded server too), and each group owns a block of G seeds (``_group_seed``). One HTTP
        call, body and answer per group instead of G, and the G requests reach the server together (its prefix
        cache shares the prompt from the first step)."""
        cls = type(self)
        default_hooks = all(
            getattr(cls, h) is getattr(AsyncRolloutLoop, h) for h in ("generate_one", "generate_one_turn")
        )
        single_turn = not self.agents.has_tools  # no tools of its own, no environment's
        G = self.settings.num_generations
        fits = G <= self.settings.max_concurrent_rollouts  # G6 bounds running rollouts; a request of G runs G
        return self.group_requests and default_hooks and single_turn and fits and G > 1

    # ------------------------------------------------------------------ old names (before the requester)

    def _next_seed(self) -> int:
        warnings.warn(
            "AsyncRolloutLoop._next_seed is deprecated: use self.requester.next_seed()", DeprecationWarning, 2
        )
        return self.requester.next_seed()

    def _turn(self, prompt_ids: list[int], res: Any) -> TurnRecord:
        warnings.warn("AsyncRolloutLoop._turn is deprecated: use self.requester.turn(...)", DeprecationWarning, 2)
        return self.requester.turn(prompt_ids, res)

    def _single_turn_rollout(self, turn: TurnRecord) -> Rollout:
        warnings.warn("AsyncRolloutLoop._single_turn_rollout is deprecated: use requests.single_turn_rollout(turn, "
                      "self.tokenizer)", DeprecationWarning, 2)  # fmt: skip
        return single_turn_rollout(turn, self.tokenizer)

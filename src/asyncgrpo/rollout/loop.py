"""``AsyncRolloutLoop``: generation, scoring and advantages in the rollout worker (G2–G7, R1–R5, T8).

Runs inside the spawned worker process (``rollout/worker.py``). For each prompt it
generates ``num_generations`` rollouts, scores the group once all are complete,
computes advantages, drops zero-std groups and queues the rest as training
sequences. Groups start only while the token-based staleness admission allows
(G3) and rollouts run only under the live concurrency cap (G5).

Subclass and override the hooks (``filter_prompt``, ``generate_one``,
``generate_one_turn``, ``compute_advantages``, ``setup``, ``close``), then set the
subclass as the trainer subclass's ``loop_cls``. The subclass must be defined at
module level (the worker re-imports it after the spawn).

The loop reads the run only through ``self.settings``, a frozen ``RolloutSettings``
the trainer built once (``rollout/settings.py``). Knobs of your own reach the hooks two
ways: fields your ``AsyncGRPOConfig`` subclass adds are copied into
``settings.extra`` and read as ``self.config.<field>``; anything else, override
``AsyncGRPOTrainer.rollout_settings`` and return
``dataclasses.replace(settings, extra={**settings.extra, ...})``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from asyncgrpo.client.answer_parse import AnswerParsers
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.client.pool import ServerPool
from asyncgrpo.client.server_rules import is_length_error
from asyncgrpo.errors import ServerError
from asyncgrpo.models.vlm import check_no_images
from asyncgrpo.rollout.admission import ConcurrencyCap, StalenessAdmission
from asyncgrpo.rollout.advantages import group_advantages, group_reward_metrics, is_zero_std_group
from asyncgrpo.rollout.agents.episode import AgentRuntime, Episode
from asyncgrpo.rollout.agents.stats import ToolLoopStats, tool_metric_events
from asyncgrpo.rollout.agents.tool_loop import ToolLoopSettings, run_tool_loop
from asyncgrpo.rollout.completion_metrics import completion_metric_events
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompt_order import PromptOrder
from asyncgrpo.rollout.reconcile import ReconcileStats, rollout_to_sequences
from asyncgrpo.rollout.rewards import reward_function_name, run_reward_functions, total_rewards
from asyncgrpo.rollout.server_poll import poll_server_metrics
from asyncgrpo.rollout.settings import ConfigView, RolloutSettings
from asyncgrpo.types import Rollout, RolloutGroup, TurnRecord

logger = logging.getLogger(__name__)

RENDER_CACHE_SIZE = 512  # rendered prompts kept (a group's G rollouts share one)
ADMISSION_POLL_S = 0.01  # how often a waiting group start re-reads the trainer's counters
END_POLL_S = 0.05  # how often the wait for the last groups re-reads the trainer's stop event
SEED_MODULUS = 2**31 - 1  # request seeds stay in int32 range for every server
# The policy version a group started under; its rollouts' tasks inherit it (adapter sync: the adapter they name).
_GROUP_VERSION: contextvars.ContextVar[int | None] = contextvars.ContextVar("asyncgrpo_group_version", default=None)
# The server a group was routed to (X5); set in the group's task, inherited by its rollouts' tasks.
_GROUP_SERVER: contextvars.ContextVar[int | None] = contextvars.ContextVar("asyncgrpo_group_server", default=None)


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
            self._tool_stats[rollout.rollout_id] = stats
            return rollout
        return self._single_turn_rollout(await self.generate_one_turn(self.render_prompt(prompt)))

    def _single_turn_rollout(self, turn: TurnRecord) -> Rollout:
        text = self.tokenizer.decode(turn.output_ids, skip_special_tokens=True)
        return Rollout(
            completion=[{"role": "assistant", "content": text}], completion_ids=turn.output_ids, turns=[turn]
        )

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with the run's sampling settings."""
        params = self.settings.sampling.request_params(len(prompt_ids), seed=self._next_seed())
        (res,) = await self._sample(prompt_ids, params)
        self._last_finish[id(asyncio.current_task())] = res.finish_reason
        return self._turn(prompt_ids, res)

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
        sampling = self.settings.sampling
        return TurnRecord(
            prompt_ids=list(prompt_ids),
            output_ids=res.token_ids,
            output_log_probs=res.logprobs,
            output_sampling_mask=res.sampling_mask if sampling.wants_masks else None,
            output_sampler_logprobs=res.top_logprobs if sampling.num_sampler_logprobs is not None else None,
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

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout: rewards standardised within the group; 0 for unscored rollouts."""
        return group_advantages(group.rewards)

    # ------------------------------------------------------------------ helpers

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

    # ------------------------------------------------------------------ the engine of the loop

    async def run(self, channels: Any) -> None:
        """Entry point called by the worker process; returns when ``channels.stop`` is set or data runs out."""
        self.channels = channels
        st = self.settings
        self._seed_counter = 0
        self._generated_tokens = 0
        self._failure: BaseException | None = None  # the first exception of a group task
        self._running = 0
        self._last_finish: dict[int, str] = {}
        self._slot_freed = asyncio.Condition()
        self._group_finished = asyncio.Event()  # wakes a group start that waits on the staleness admission
        # Sync tools, reset/get_reward and sync reward functions share this pool: one thread per concurrent
        # rollout (G6 in docs/spec.md); threads start lazily, so a large cap costs nothing until used.
        self._executor = ThreadPoolExecutor(max_workers=st.max_concurrent_rollouts)
        self._tool_stats: dict[str, ToolLoopStats] = {}
        self.agents = AgentRuntime(self.tools, self.environment_factory, self._executor, channels.put_metric)
        self._answer_parsers = AnswerParsers(st.answer_parse_processes)
        self.pool = ServerPool(
            st.sampling.urls,
            timeout=st.request_timeout_s,
            max_connections=st.max_concurrent_rollouts,
            retry_for_s=st.retry_for_s,
            answer_parsers=self._answer_parsers,
        )
        self._score_slots = asyncio.Semaphore(min(st.max_concurrent_rollouts, 64))  # the reward threads
        self._score_waiting = 0
        self.admission = StalenessAdmission(st.max_staleness, st.initial_tokens_per_step)
        self.cap = ConcurrencyCap(
            st.max_concurrent_rollouts,
            st.sampling.kv_cache_tokens,
            st.sampling.max_model_len,
            has_metrics=st.sampling.has_metrics,
        )
        self._answer_parsers.start()  # in the background: answers are parsed inline until a helper is up
        await self.setup()
        poller = asyncio.create_task(self._poll_server_metrics())
        try:
            await self._produce()
        finally:
            poller.cancel()
            try:
                await self.close()
            finally:
                await self.pool.close()
                await self._answer_parsers.close()
                self._executor.shutdown(wait=False, cancel_futures=True)

    def _sync_admission(self) -> None:
        self.admission.on_trainer_report(self.channels.tokens_consumed.value, self.channels.tokens_per_step.value)

    def _trainer_wants_samples(self) -> bool:
        """Always, unless ``sync_rollouts``: then only while the trainer waits for a step's samples."""
        gate = getattr(self.channels, "trainer_waiting", None)
        return not self.settings.sync_rollouts or gate is None or gate.is_set()

    async def _wait_for_admission(self, tasks: set[asyncio.Task]) -> None:
        t0 = time.perf_counter()
        while True:
            await self._raise_failed(tasks)  # a failed group must stop the run even while generation waits
            self._sync_admission()
            if self.channels.stop.is_set():
                break
            if self.admission.can_start_group() and self._trainer_wants_samples():
                break
            # Woken at once when a group finishes (the first one unblocks G3's one-at-a-time start); the trainer's
            # counters are shared memory without a signal, so they are polled every 10 ms.
            self._group_finished.clear()
            try:
                await asyncio.wait_for(self._group_finished.wait(), ADMISSION_POLL_S)
            except TimeoutError:
                pass
        waited = time.perf_counter() - t0
        self.channels.put_metric("rollout/backpressure_s", waited)

    async def _produce(self) -> None:
        st = self.settings
        order = PromptOrder(self.dataset, st.dataset_start_index, st.num_epochs, st.skip_indices)
        group_id = 0
        tasks: set[asyncio.Task] = set()
        for epoch in order.epochs():
            if self.channels.stop.is_set():
                break
            accepted = rejected = 0
            for row_index, flat_index, row in order.epoch_rows(epoch):
                if self.channels.stop.is_set():
                    break
                if not self.filter_prompt(row_index, row, epoch):
                    self.channels.samples.put(GroupResult.rejected(flat_index, epoch))
                    rejected += 1
                    continue
                accepted += 1
                await self._wait_for_admission(tasks)
                if self.channels.stop.is_set():
                    break
                self.admission.on_group_started()
                task = asyncio.create_task(self._run_group(row_index, flat_index, row, epoch, group_id))
                tasks.add(task)
                task.add_done_callback(lambda t: self._on_group_done(t, tasks))
                group_id += 1
                await self._raise_failed(tasks)
            if accepted == 0 and rejected == order.epoch_len and not self.channels.stop.is_set():
                raise ValueError(
                    f"filter_prompt rejected every prompt of epoch {epoch}; no batch can reach the trainer"
                )
        # The last groups: woken as each one ends (a fixed sleep here held the end-of-data marker up to 50 ms after
        # the last sample); the timeout only re-reads the trainer's stop event, which has no awaitable.
        while not self.channels.stop.is_set():
            await self._raise_failed(tasks)
            pending = {t for t in tasks if not t.done()}
            if not pending:
                break
            await asyncio.wait(pending, timeout=END_POLL_S, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0)  # the done-callbacks of groups that just ended record their failures first
        await self._raise_failed(tasks)
        if self.channels.stop.is_set():  # the trainer is done: drop in-flight rollouts quietly
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return
        self.channels.samples.put(GroupResult.end_of_data())

    async def _raise_failed(self, tasks: set[asyncio.Task]) -> None:
        if self._failure is not None:
            for other in tasks:
                other.cancel()
            raise self._failure

    def _on_group_done(self, task: asyncio.Task, tasks: set[asyncio.Task]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()

    async def _acquire_slot(self, count: int = 1) -> None:
        """Take ``count`` rollout slots at once (a group sent as one request takes G): taking them one by one,
        two groups could each hold part of what both need. More than the cap starts only when nothing runs."""
        async with self._slot_freed:
            while self._running and self._running + count > self.cap.cap:
                try:
                    await self._slot_freed.wait()
                except asyncio.CancelledError:  # pass on a wake-up this waiter may have taken (it holds the lock)
                    if self._running < self.cap.cap:
                        self._slot_freed.notify(1)
                    raise
            self._running += count
            if self._running < self.cap.cap:  # room left (the cap grew): pass the wake-up on to the next one
                self._slot_freed.notify(1)
        self.channels.put_metric("rollout/concurrency", self._running)

    async def _release_slot(self, count: int = 1) -> None:
        async with self._slot_freed:
            self._running -= count
            for _ in range(count):
                self.cap.on_rollout_completed()
            # As many waiters woken as slots freed (each wakes the next if room is left): notify_all would wake
            # every queued rollout on each completion, work that grows with concurrency.
            self._slot_freed.notify(count)

    async def _one_rollout(
        self, row: dict[str, Any], prompt: list[dict[str, Any]] | None, group_id: int, server: int
    ) -> tuple[Rollout, str, Episode]:
        try:
            await self._acquire_slot()
            t0 = time.perf_counter()
            episode: Episode | None = None
            try:
                episode = await self.agents.start(row, prompt)  # an environment instance, reset (A4)
                rollout = await self.generate_one(episode.prompt, episode.tools, group_id)
                episode.env_reward = await self.agents.finish(episode)
            finally:
                if episode is not None:
                    self.agents.release(episode)
                await self._release_slot()
        finally:
            self.pool.finish(server)  # the routing load counts the rollout until it is done
        self.channels.put_metric("rollout/duration_s", time.perf_counter() - t0)
        finish = self._last_finish.pop(id(asyncio.current_task()), "stop")
        return rollout, finish, episode

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

    async def _one_request_group(
        self, row: dict[str, Any], prompt: Any, group_id: int, server: int
    ) -> list[tuple[Rollout, str, Episode]]:
        """A group's G single-turn rollouts from one request for G choices (see ``_group_as_one_request``)."""
        G = self.settings.num_generations
        try:
            await self._acquire_slot(G)
            t0 = time.perf_counter()
            try:
                episodes = [await self.agents.start(row, prompt) for _ in range(G)]  # no environment: the prompt
                prompt_ids = self.render_prompt(episodes[0].prompt)
                params = self.settings.sampling.request_params(len(prompt_ids), seed=self._group_seed(group_id))
                params["n"] = G
                results = await self._sample(prompt_ids, params)
            finally:
                await self._release_slot(G)
        finally:
            for _ in range(G):
                self.pool.finish(server)
        if len(results) != G:
            raise RuntimeError(f"the generation server answered {len(results)} choices to a request for n={G}")
        duration = time.perf_counter() - t0
        out = []
        for res, episode in zip(results, episodes):
            self.channels.put_metric("rollout/duration_s", duration)
            out.append((self._single_turn_rollout(self._turn(prompt_ids, res)), res.finish_reason, episode))
        return out

    async def _run_group(self, row_index: int, flat_index: int, row: dict[str, Any], epoch: int, group_id: int) -> None:
        prompt = row.get("prompt") if isinstance(row, dict) else None
        env_owns_prompt = self.environment_factory is not None and prompt is None  # reset() returns the prompt
        if not env_owns_prompt and not (
            isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt)
        ):
            raise ValueError(
                f"dataset row {row_index} has prompt={prompt!r}; prompts must be conversational: a list of "
                '{"role": ..., "content": ...} messages'
            )
        check_no_images(row, f"dataset row {row_index}")
        version = self.channels.policy_version.value
        _GROUP_VERSION.set(version)  # this task's context: the rollouts gathered below copy it
        G = self.settings.num_generations
        self.pool.drop_flagged(self.channels.dropped_server_mask())
        server = self.pool.assign(G)  # the G requests meet on one server: its prefix cache shares the prompt
        _GROUP_SERVER.set(server)  # this task's context; gather's tasks copy it
        if self._group_as_one_request():
            results = await self._one_request_group(row, prompt, group_id, server)
        else:
            results = await asyncio.gather(*(self._one_rollout(row, prompt, group_id, server) for _ in range(G)))
        # Finished groups queue for a reward thread; generation never waits on that queue (score_block_s = 0).
        t_done = time.perf_counter()
        self._score_waiting += 1
        self.channels.put_metric("rollout/score_queue_size", float(self._score_waiting))
        await self._score_slots.acquire()
        self._score_waiting -= 1
        try:
            self.channels.put_metric("rollout/score_wait_s", time.perf_counter() - t_done)
            self.channels.put_metric("rollout/score_block_s", 0.0)
            await self._score_group(row_index, flat_index, row, epoch, group_id, version, prompt, results)
        finally:
            self._score_slots.release()

    async def _score_group(self, row_index: int, flat_index: int, row: dict[str, Any], epoch: int, group_id: int,
                           version: int, prompt: list[dict[str, Any]], results: list[tuple[Any, ...]]) -> None:  # fmt: skip
        G = self.settings.num_generations
        rollouts = [r for r, _, _ in results]
        prompts = [e.prompt for _, _, e in results]
        env_rewards = [e.env_reward for _, _, e in results]
        t_score = time.perf_counter()
        reward_kwargs = {k: [v] * G for k, v in row.items() if k != "prompt"}
        per_func = await run_reward_functions(
            self.reward_funcs,
            prompts=prompts,
            completions=[r.completion for r in rollouts],
            completion_ids=[r.completion_ids for r in rollouts],
            reward_kwargs=reward_kwargs,
            executor=self._executor,
        )
        stats = ReconcileStats()
        sequences = [
            rollout_to_sequences(
                r,
                group_id=group_id,
                row_index=flat_index,
                model_version=version,
                num_sampler_logprobs=self.settings.num_sampler_logprobs,
                stats=stats,
            )
            for r in rollouts
        ]
        group = RolloutGroup(
            prompts=prompts,
            reward_kwargs=reward_kwargs,
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=sequences,
            tool_call_counts=[r.tool_call_count for r in rollouts],
            tool_failure_counts=[r.tool_failure_count for r in rollouts],
            model_version=version,
            group_id=group_id,
            row_index=row_index,
            env_rewards=env_rewards,
            rollout_rewards=[r.reward for r in rollouts],
            queued_at=time.monotonic(),
        )
        group.rewards = total_rewards(per_func, [e and e[1] for e in env_rewards], group.rollout_rewards)
        advantages = np.asarray(self.compute_advantages(group), dtype=np.float64)
        if advantages.shape != (G,):
            raise ValueError(f"compute_advantages returned shape {advantages.shape}; expected ({G},)")
        dropped = is_zero_std_group(group.rewards)
        per_source = {reward_function_name(f): per_func[:, j] for j, f in enumerate(self.reward_funcs)}
        for cls in {e[0] for e in env_rewards if e is not None}:  # rewards/<EnvClass>/mean
            per_source[cls.__name__] = np.array([e[1] if e and e[0] is cls else np.nan for e in env_rewards])
        num_samples = sum(len(seqs) for seqs in sequences)
        events = group_reward_metrics(group.rewards, per_source, dropped, num_samples)
        events += completion_metric_events(rollouts, [f for _, f, _ in results])
        events += stats.metric_events(num_samples, G)
        if self.agents.has_tools:  # tools/* only when the run has tools (M1)
            loop_stats = [self._tool_stats.pop(r.rollout_id, None) for r in rollouts]
            fails = [r.tool_failure_count for r in rollouts]
            events += tool_metric_events([r.tool_call_count for r in rollouts], fails, loop_stats)
        for name, value, weight in events:
            self.channels.put_metric(name, value, weight)
        self.channels.put_metric("rollout/score_s", time.perf_counter() - t_score)
        kept: list[Any] = []
        if not dropped:
            for seqs, adv in zip(sequences, advantages):
                for s in seqs:
                    s.advantage = float(adv)
                    try:
                        s.validate()  # e.g. a sampled token outside its own candidate set would train as NaN
                    except ValueError as e:
                        logger.warning("dropping a training sample of group %d: %s", group_id, e)
                        continue
                    kept.append(s)
        tokens = sum(len(s.input_ids) for seqs in sequences for s in seqs)
        kept_tokens = sum(len(s.input_ids) for s in kept)
        self.admission.on_group_finished(tokens, kept_tokens)
        self._group_finished.set()
        self.channels.count_queued(len(kept))
        log_texts = self.settings.log_completions
        self.channels.flush_metrics()  # the group's metrics go out ahead of its samples
        self.channels.samples.put(
            GroupResult(
                row_index=flat_index,
                epoch=epoch,
                group_id=group_id,
                model_version=version,
                sequences=kept,
                dropped=dropped,
                queued_at=time.time(),
                tokens=kept_tokens,
                prompt_text=self.tokenizer.apply_chat_template(prompts[0], tokenize=False, add_generation_prompt=True)
                if log_texts
                else None,
                completion_texts=[r.completion[-1]["content"] if r.completion else "" for r in rollouts]
                if log_texts
                else None,
                rewards=[float(x) for x in group.rewards],
                tool_calls=sum(r.tool_call_count for r in rollouts) if self.agents.has_tools else None,
            )
        )

    async def _poll_server_metrics(self) -> None:
        """G5: read the server's /metrics every few seconds and move the concurrency cap (``server_poll.py``)."""
        await poll_server_metrics(self.settings.sampling.has_metrics, self.pool, self.cap, self.channels,
                                  lambda: self._generated_tokens)  # fmt: skip

"""The long-running part of the rollout loop: groups kept in flight, their rollouts, scoring and queueing (G2-G7).

``ProductionMixin`` is a base of ``AsyncRolloutLoop`` (``rollout/loop.py``) and calls the hooks defined there.
``run`` walks the prompts epoch by epoch; a group starts only while the token-based staleness admission allows
(G3), its rollouts run only under the live concurrency cap (G5), and a finished group is scored
(``scoring.py``) and queued to the trainer as one ``GroupResult``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asyncgrpo.client.answer_parse import AnswerParsers
from asyncgrpo.client.pool import ServerPool
from asyncgrpo.models.vlm import check_no_images
from asyncgrpo.rollout.admission import ConcurrencyCap, StalenessAdmission
from asyncgrpo.rollout.agents.episode import AgentRuntime, Episode
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompt_order import PromptOrder
from asyncgrpo.rollout.requests import _GROUP_SERVER, _GROUP_VERSION, RequestMixin
from asyncgrpo.rollout.rewards import reward_function_name, run_reward_functions
from asyncgrpo.rollout.scoring import GroupOrigin, score_group, trainable_samples
from asyncgrpo.rollout.server_poll import poll_server_metrics
from asyncgrpo.types import Rollout

logger = logging.getLogger(__name__)

ADMISSION_POLL_S = 0.01  # how often a waiting group start re-reads the trainer's counters
END_POLL_S = 0.05  # how often the wait for the last groups re-reads the trainer's stop event


class ProductionMixin(RequestMixin):
    """The machinery behind the hooks; its state is set up by ``run`` in the worker process.

    It calls what ``AsyncRolloutLoop`` defines: the hooks ``filter_prompt``, ``setup``, ``close``, ``generate_one``
    and ``compute_advantages``, and the helpers ``render_prompt`` and ``_group_as_one_request``.
    """

    dataset: Any
    reward_funcs: list[Any]
    tools: list[Any]
    environment_factory: dict[str, Any] | None

    async def run(self, channels: Any) -> None:
        """Entry point called by the worker process; returns when ``channels.stop`` is set or data runs out."""
        self.channels = channels
        st = self.settings
        self._seed_counter = 0
        self._generated_tokens = 0
        self._failure: BaseException | None = None  # the first exception of a group task
        self._running = 0
        self._slot_freed = asyncio.Condition()
        self._group_finished = asyncio.Event()  # wakes a group start that waits on the staleness admission
        # Sync tools, reset/get_reward and sync reward functions share this pool: one thread per concurrent
        # rollout (G6 in docs/spec.md); threads start lazily, so a large cap costs nothing until used.
        self._executor = ThreadPoolExecutor(max_workers=st.max_concurrent_rollouts)
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
        self.admission = StalenessAdmission(st.max_staleness, st.initial_tokens_per_step, st.oversample_cap)
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
    ) -> tuple[Rollout, Episode]:
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
        return rollout, episode

    async def _one_request_group(
        self, row: dict[str, Any], prompt: Any, group_id: int, server: int
    ) -> list[tuple[Rollout, Episode]]:
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
            out.append((self._single_turn_rollout(self._turn(prompt_ids, res)), episode))
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
            origin = GroupOrigin(group_id, row_index, flat_index, epoch, version)
            await self._score_group(origin, row, [r for r, _ in results], [e for _, e in results])
        finally:
            self._score_slots.release()

    async def _score_group(
        self, origin: GroupOrigin, row: dict[str, Any], rollouts: list[Rollout], episodes: list[Episode]
    ) -> None:
        """Run the reward functions, score the group (``scoring.py``) and queue its samples."""
        G = len(rollouts)
        prompts = [e.prompt for e in episodes]
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
        scored = score_group(
            rollouts,
            prompts,
            [e.env_reward for e in episodes],
            per_func,
            reward_names=[reward_function_name(f) for f in self.reward_funcs],
            reward_kwargs=reward_kwargs,
            origin=origin,
            num_sampler_logprobs=self.settings.num_sampler_logprobs,
            has_tools=self.agents.has_tools,
            compute_advantages=self.compute_advantages,
            queued_at=time.monotonic(),
        )
        for name, value, weight in scored.events:
            self.channels.put_metric(name, value, weight)
        self.channels.put_metric("rollout/score_s", time.perf_counter() - t_score)
        kept, problems = trainable_samples(scored)
        for problem in problems:
            logger.warning("dropping a training sample of group %d: %s", origin.group_id, problem)
        tokens = sum(len(s.input_ids) for seqs in scored.sequences for s in seqs)
        kept_tokens = sum(len(s.input_ids) for s in kept)
        self.admission.on_group_finished(tokens, kept_tokens)
        self._group_finished.set()
        self.channels.count_queued(len(kept))
        log_texts = self.settings.log_completions
        self.channels.flush_metrics()  # the group's metrics go out ahead of its samples
        self.channels.samples.put(
            GroupResult(
                row_index=origin.flat_index,
                epoch=origin.epoch,
                group_id=origin.group_id,
                model_version=origin.model_version,
                sequences=kept,
                dropped=scored.dropped,
                queued_at=time.time(),
                tokens=kept_tokens,
                prompt_text=self.tokenizer.apply_chat_template(prompts[0], tokenize=False, add_generation_prompt=True)
                if log_texts
                else None,
                completion_texts=[r.completion[-1]["content"] if r.completion else "" for r in rollouts]
                if log_texts
                else None,
                rewards=[float(x) for x in scored.group.rewards],
                tool_calls=sum(r.tool_call_count for r in rollouts) if self.agents.has_tools else None,
                dataset_row=origin.row_index,
            )
        )

    async def _poll_server_metrics(self) -> None:
        """G5: read the server's /metrics every few seconds and move the concurrency cap (``server_poll.py``)."""
        await poll_server_metrics(self.settings.sampling.has_metrics, self.pool, self.cap, self.channels,
                                  lambda: self._generated_tokens)  # fmt: skip

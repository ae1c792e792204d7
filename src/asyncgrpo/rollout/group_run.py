"""The group runner: one group from its prompt to its queued ``GroupResult`` (G2, G5, R1-R5).

``GroupRunner.run`` routes the group to a server, runs its G rollouts (each under a concurrency slot, G5) through
the loop's ``generate_one`` hook, or sends a single-turn group as one request for G choices; then it runs the
reward functions, scores the group with the pure ``score_group`` (``scoring.py``) and queues the result. It reaches
the user's loop only through ``GroupHooks``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Executor
from typing import Any, Protocol

import numpy as np

from asyncgrpo.client.pool import ServerPool
from asyncgrpo.models.vlm import check_no_images
from asyncgrpo.rollout.admission import RolloutSlots
from asyncgrpo.rollout.agents.episode import AgentRuntime, Episode
from asyncgrpo.rollout.dynamic_sampling import row_tokens
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.production import GroupOutcome
from asyncgrpo.rollout.prompt_order import PromptItem
from asyncgrpo.rollout.queue_bound import wait_for_queue_room
from asyncgrpo.rollout.requests import GroupRoute, Requester, enter_group, single_turn_rollout
from asyncgrpo.rollout.rewards import reward_function_name, run_reward_functions
from asyncgrpo.rollout.scoring import GroupOrigin, score_group, trainable_samples
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.types import Rollout, RolloutGroup

logger = logging.getLogger(__name__)

SCORE_THREADS_MAX = 64  # groups scored at once: their reward functions share the executor's threads


class GroupHooks(Protocol):
    """What the runner calls on the user's loop (``AsyncRolloutLoop`` and its subclasses)."""

    async def generate_one(self, prompt: list[dict[str, Any]], tools: list[Any], group_id: int = 0) -> Rollout: ...

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray: ...

    def render_prompt(self, prompt: list[dict[str, Any]]) -> list[int]: ...

    async def _sample(self, prompt_ids: list[int], params: dict[str, Any]) -> list[Any]: ...


class GroupRunner:
    """Runs groups for the producer (``run`` is its ``run_group``).

    Args:
        hooks: the user's loop.
        settings: the run's settings.
        requester: seeds and answers as turns; the loop's ``_sample`` sends through it.
        slots: the concurrency slots (G5).
        agents: tools and environments of the run.
        pool: the servers (a group's rollouts are routed to one, X5).
        channels: the worker's channels (``samples``, ``policy_version``, metrics).
        reward_funcs: the reward functions.
        executor: threads for sync reward functions.
        tokenizer: renders the logged prompt text and decodes single-turn completions.
        has_environments: whether the run has an ``environment_factory`` (its ``reset`` may supply the prompt).
        one_request: whether a group goes out as one request for its G choices (decided once by the loop).
    """

    def __init__(
        self,
        hooks: GroupHooks,
        settings: RolloutSettings,
        requester: Requester,
        slots: RolloutSlots,
        agents: AgentRuntime,
        pool: ServerPool,
        channels: Any,
        *,
        reward_funcs: list[Any],
        executor: Executor,
        tokenizer: Any,
        has_environments: bool,
        one_request: bool,
    ) -> None:
        self.hooks = hooks
        self.settings = settings
        self.requester = requester
        self.slots = slots
        self.agents = agents
        self.pool = pool
        self.channels = channels
        self.reward_funcs = reward_funcs
        self.executor = executor
        self.tokenizer = tokenizer
        self.has_environments = has_environments
        self.one_request = one_request
        self._score_slots = asyncio.Semaphore(min(settings.max_concurrent_rollouts, SCORE_THREADS_MAX))
        self._score_waiting = 0

    async def run(self, item: PromptItem, group_id: int) -> GroupOutcome:
        """Generate, score and queue the group of ``item``; runs in the group's own task."""
        row_index, row = item.row_index, item.row
        prompt = row.get("prompt") if isinstance(row, dict) else None
        env_owns_prompt = self.has_environments and prompt is None  # reset() returns the prompt
        if not env_owns_prompt and not (
            isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt)
        ):
            raise ValueError(
                f"dataset row {row_index} has prompt={prompt!r}; prompts must be conversational: a list of "
                '{"role": ..., "content": ...} messages'
            )
        check_no_images(row, f"dataset row {row_index}")
        version = self.channels.policy_version.value
        G = self.settings.num_generations
        self.pool.drop_flagged(self.channels.dropped_server_mask())
        server = self.pool.assign(G)  # the G requests meet on one server: its prefix cache shares the prompt
        enter_group(GroupRoute(server, version))  # this task's context: the rollouts gathered below copy it
        if self.one_request:
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
            origin = GroupOrigin(group_id, row_index, item.flat_index, item.epoch, version)
            return await self._score(origin, row, [r for r, _ in results], [e for _, e in results])
        finally:
            self._score_slots.release()

    async def _one_rollout(
        self, row: dict[str, Any], prompt: list[dict[str, Any]] | None, group_id: int, server: int
    ) -> tuple[Rollout, Episode]:
        try:
            await self.slots.acquire()
            t0 = time.perf_counter()
            episode: Episode | None = None
            try:
                episode = await self.agents.start(row, prompt)  # an environment instance, reset (A4)
                rollout = await self.hooks.generate_one(episode.prompt, episode.tools, group_id)
                episode.env_reward = await self.agents.finish(episode)
            finally:
                if episode is not None:
                    self.agents.release(episode)
                await self.slots.release()
        finally:
            self.pool.finish(server)  # the routing load counts the rollout until it is done
        self.channels.put_metric("rollout/duration_s", time.perf_counter() - t0)
        return rollout, episode

    async def _one_request_group(
        self, row: dict[str, Any], prompt: Any, group_id: int, server: int
    ) -> list[tuple[Rollout, Episode]]:
        """A group's G single-turn rollouts from one request for G choices (see
        ``AsyncRolloutLoop._group_as_one_request``)."""
        G = self.settings.num_generations
        try:
            await self.slots.acquire(G)
            t0 = time.perf_counter()
            try:
                episodes = [await self.agents.start(row, prompt) for _ in range(G)]  # no environment: the prompt
                prompt_ids = self.hooks.render_prompt(episodes[0].prompt)
                params = self.settings.sampling.request_params(
                    len(prompt_ids), seed=self.requester.group_seed(group_id)
                )
                params["n"] = G
                results = await self.hooks._sample(prompt_ids, params)
            finally:
                await self.slots.release(G)
        finally:
            for _ in range(G):
                self.pool.finish(server)
        if len(results) != G:
            raise RuntimeError(f"the generation server answered {len(results)} choices to a request for n={G}")
        duration = time.perf_counter() - t0
        out = []
        for res, episode in zip(results, episodes):
            self.channels.put_metric("rollout/duration_s", duration)
            turn = self.requester.turn(prompt_ids, res)
            out.append((single_turn_rollout(turn, self.tokenizer), episode))
        return out

    async def _score(
        self, origin: GroupOrigin, row: dict[str, Any], rollouts: list[Rollout], episodes: list[Episode]
    ) -> GroupOutcome:
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
            executor=self.executor,
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
            compute_advantages=self.hooks.compute_advantages,
            queued_at=time.monotonic(),
            fork_threshold_tokens=self.settings.fork_threshold_tokens,
        )
        for name, value, weight in scored.events:
            self.channels.put_metric(name, value, weight)
        self.channels.put_metric("rollout/score_s", time.perf_counter() - t_score)
        kept, problems = trainable_samples(scored)
        for problem in problems:
            logger.warning("dropping a training sample of group %d: %s", origin.group_id, problem)
        tokens = sum(len(s.input_ids) for seqs in scored.sequences for s in seqs)
        kept_tokens = sum(len(s.input_ids) for s in kept)
        await wait_for_queue_room(self.channels, len(kept), self.settings.queue_maxsize)
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
                row_tokens=row_tokens([s for seqs in scored.sequences for s in seqs]) if scored.dropped else 0,
            )
        )
        return GroupOutcome(tokens, kept_tokens, tuple(float(x) for x in scored.group.rewards))

"""Held-out evaluation of agent sets: every episode runs through the training's own rollout loop (issue 36).

An eval set that names an ``environment_factory`` or ``tools`` is not scored by the single-turn path of
``tasks/evaluate.py``. Each of its rows becomes a group of ``num_samples`` episodes, run by the run's rollout loop
class (``AsyncRolloutLoop``, or the trainer's ``loop_cls`` with its hooks) through the ``GroupRunner`` that runs
training groups: the same environment ``reset``, multi-turn tool loop, tool execution, ``max_tool_calling_iterations``,
``get_reward`` and reward functions, summed into each episode's total reward the same way. Those totals then feed
the same pass@k / mean@k / maj@k as any set (``tasks/eval_metrics.py``).

Where it runs, and why: in the process that asks for the evaluation (the trainer's rank 0, or ``asyncgrpo eval``),
against the generation server over HTTP, not inside the rollout worker. The worker's producer starts a group only
when the token-based staleness admission (G3) allows and puts every result on the trainer's sample queue; an
evaluation group must do neither: it must not spend the training's token allowance, wait behind it, or reach the
training batches. So the loop's components are built afresh here (``AsyncRolloutLoop.components``) with channels of
their own (``EvalChannels``): their own concurrency slots (capped at the evaluation's ``concurrency``), server pool
and environment pool, no admission, results kept in this process. The environments never cross a process, so they
need not pickle. The worker, when one runs, keeps generating beside the evaluation on the same server.
"""

from __future__ import annotations

import asyncio
import copy
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from asyncgrpo.client.http_client import AsyncServerClient, base_model_card
from asyncgrpo.rollout.agents.templates import prepare_tool_template
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompt_order import PromptItem
from asyncgrpo.rollout.rewards import reward_function_name
from asyncgrpo.rollout.sampling import SamplingSettings
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.tasks.eval_metrics import answer_extractor, set_metrics
from asyncgrpo.tasks.evaluate import EvalSettings

# The runner's per-group metric events an agent set reports (weighted means over its episodes), beside reward
# means per source (``rewards/<name>/mean``: each reward function and each environment class).
AGENT_FIGURES = (
    "completions/mean_length",
    "completions/clipped_ratio",
    "tools/call_frequency",
    "tools/failure_frequency",
    "tools/loop_exhausted_frac",
    "rollout/turns_mean",
)


class _Value:
    """Stands for a shared ``mp.Value``: the runner reads ``.value``."""

    def __init__(self, value: int) -> None:
        self.value = value


class EvalChannels:
    """What a ``GroupRunner`` writes to during an evaluation; results and metric events stay in this process.

    It has no ``samples_queued`` counter (so no queue bound holds a group) and no trainer counters: nothing here
    reaches the training's staleness admission or sample queue.
    """

    def __init__(self, policy_version: int = 0) -> None:
        self.policy_version = _Value(policy_version)
        self.stop = threading.Event()  # never set: an evaluation runs every row
        self.results: list[GroupResult] = []
        self.events: list[tuple[str, float, float]] = []
        self.samples = self  # the runner queues each scored group with ``channels.samples.put``

    def put(self, result: GroupResult) -> None:
        self.results.append(result)

    def put_metric(self, name: str, value: float, weight: float = 1.0) -> None:
        self.events.append((name, float(value), float(weight)))

    def flush_metrics(self) -> None:
        """Events are read in this process: nothing to hand on."""

    def count_queued(self, delta: int) -> None:
        """No sample queue: nothing to count."""

    def dropped_server_mask(self) -> int:
        return 0


def agent_rollout_settings(
    s: EvalSettings, served_model: str, max_model_len: int, max_iterations: int | None, extra: Mapping[str, Any]
) -> RolloutSettings:
    """The loop's settings for one agent set: its samples, temperature and completion length; the staleness fields
    are placeholders (``evaluation=True``: no admission reads them). Sampling beyond temperature and top_k is left
    at the server's plain values, as in the single-turn path."""
    sampled = s.temperature > 0
    sampling = SamplingSettings(
        base_url=s.base_url, max_model_len=max_model_len, max_completion_length=s.max_tokens,
        temperature=s.temperature, top_k=s.top_k if sampled else 0, has_metrics=False,
    )  # fmt: skip
    return RolloutSettings(
        model_name=s.model or served_model, sampling=sampling, num_generations=s.num_samples, max_staleness=0,
        seed=s.seed, max_concurrent_rollouts=s.concurrency, initial_tokens_per_step=1, request_timeout_s=s.timeout,
        chat_template_kwargs=dict(s.chat_template_kwargs or {}), max_tool_calling_iterations=max_iterations,
        log_completions=True, answer_parse_processes=0, extra=dict(extra), pass_threshold=s.pass_threshold,
        evaluation=True,
    )  # fmt: skip


async def served_model(base_url: str, timeout: float) -> tuple[str, int]:
    """The served model's name and ``max_model_len`` (``/v1/models``): the tool loop stops a conversation there."""
    async with AsyncServerClient(base_url) as client:
        await client.wait_until_ready(timeout)
        models = await client.models()
    base = base_model_card(models)
    if base is None or not base.get("max_model_len"):
        raise RuntimeError(f"/v1/models of {base_url} names no model with a max_model_len; is it a vLLM server?")
    return str(base["id"]), int(base["max_model_len"])


def tool_tokenizer(tokenizer: Any, chat_template_kwargs: dict[str, Any] | None) -> Any:
    """A copy of ``tokenizer`` fit for the tool loop (``prepare_tool_template``), as training's with tools: the
    caller's tokenizer keeps its template (a run without tools trains on its own rendering)."""
    tok = copy.deepcopy(tokenizer)
    prepare_tool_template(tok, chat_template_kwargs)
    return tok


async def evaluate_agent_set(
    tokenizer: Any,
    dataset: Any,
    reward_funcs: Sequence[Any],
    s: EvalSettings,
    *,
    tools: Sequence[Any],
    environment_factory: Mapping[str, Any] | None,
    loop_cls: type,
    prefix: str = "eval",
    progress: Callable[[], None] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Every row of ``dataset`` as a group of ``s.num_samples`` episodes through ``loop_cls``'s group runner.

    Args:
        reward_funcs: the set's reward functions (may be empty when the environment's ``get_reward`` scores).
        tools, environment_factory: the set's, as the trainer takes them (factories as a dict, ``{"": f}`` for one).
        loop_cls: the run's rollout loop class (``AsyncGRPOTrainer.loop_cls``).
        progress: called once per scored row.
        extra: the loop's ``settings.extra`` (fields of an ``AsyncGRPOConfig`` subclass, ``self.config``).

    Returns:
        ``{prefix}/reward``, ``{prefix}/num_prompts``, the ``{prefix}/`` figures of ``AGENT_FIGURES`` and
        ``rewards/<source>/mean``, and mean@k / pass@k / maj@k (``set_metrics``).
    """
    name, max_len = await served_model(s.base_url, s.timeout)
    settings = agent_rollout_settings(s, name, max_len, s.max_tool_calling_iterations, extra or {})
    tok = tool_tokenizer(tokenizer, settings.chat_template_kwargs)
    loop = loop_cls(settings, dataset, list(reward_funcs), tok, tools=list(tools),
                    environment_factory=dict(environment_factory) if environment_factory else None)  # fmt: skip
    channels = EvalChannels()
    async with loop.components(channels) as runner:
        check_buildable(loop.agents.pool, prefix)

        async def one(i: int) -> None:
            await runner.run(PromptItem(epoch=0, row_index=i, flat_index=i, row=dataset[i]), i)
            if progress is not None:
                progress()

        tasks = [asyncio.ensure_future(one(i)) for i in range(len(dataset))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # the first failure ends the set: its other groups stop before the pools close
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
    return agent_set_metrics(channels, reward_funcs, prefix, s.pass_threshold, len(dataset))


def check_buildable(pool: Any, prefix: str) -> None:
    """One environment of each factory built before any request, and left in the pool for the first episode: a
    factory that cannot build fails here, naming its set, instead of inside the first group's task."""
    where = f"eval set {prefix.rsplit('/', 1)[-1]}"
    for name, factory in (pool.factories if pool is not None else {}).items():
        what = f"environment_factory[{name!r}]" if name else "environment_factory"
        try:
            env = factory()
        except Exception as e:
            raise ValueError(
                f"{where}: {what} could not build an environment ({type(e).__name__}: {e}); fix the "
                "factory (it is called with no arguments) or give the set another one"
            ) from e
        if not callable(getattr(env, "reset", None)):
            raise TypeError(f"{where}: {what} returned {type(env).__name__}, which has no reset() method; "
                            "environments need reset(self, **kwargs) -> str | None")  # fmt: skip
        pool.release(name, env)


def agent_set_metrics(
    channels: EvalChannels, reward_funcs: Sequence[Any], prefix: str, pass_threshold: float, num_prompts: int
) -> dict[str, float]:
    """The set's figures from its scored groups (in row order) and the runner's metric events."""
    results = sorted(channels.results, key=lambda r: r.dataset_row if r.dataset_row is not None else r.row_index)
    rewards = [list(r.rewards or []) for r in results]
    totals = np.array([x for rs in rewards for x in rs], dtype=np.float64)
    totals = totals[~np.isnan(totals)]
    out = {f"{prefix}/reward": float(totals.mean()) if totals.size else math.nan}
    sums: dict[str, list[float]] = {}
    for name, value, weight in channels.events:
        wanted = name in AGENT_FIGURES or (name.startswith("rewards/") and name.endswith("/mean"))
        if wanted and not math.isnan(value) and weight > 0:
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] += value * weight
            acc[1] += weight
    for name in (*AGENT_FIGURES, *(f"rewards/{reward_function_name(f)}/mean" for f in reward_funcs)):
        out[f"{prefix}/{name}"] = math.nan
    out.update({f"{prefix}/{name}": total / weight for name, (total, weight) in sums.items()})
    out[f"{prefix}/num_prompts"] = float(num_prompts)
    extract = answer_extractor(reward_funcs)
    answers = [[extract(t) for t in r.completion_texts or []] for r in results] if extract is not None else None
    out.update({f"{prefix}/{k}": v for k, v in set_metrics(rewards, answers, pass_threshold).items()})
    return out


def evaluate_agent_set_sync(*args: Any, **kwargs: Any) -> dict[str, float]:
    """Blocking ``evaluate_agent_set`` (the trainer's main thread runs no event loop)."""
    return asyncio.run(evaluate_agent_set(*args, **kwargs))

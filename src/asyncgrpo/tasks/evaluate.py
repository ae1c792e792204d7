"""Held-out evaluation (X7): generate on the server for every prompt of a dataset, score with the reward functions.

Used twice: by the trainer at ``eval_steps`` (``eval/*`` metrics, on the weights the server holds, i.e. the last
sync) and by ``asyncgrpo eval`` (``cli/eval.py``) for a saved checkpoint; several named sets go through
``tasks/eval_sets.py``. Generation goes through ``/v1/completions`` with token-id prompts, which vLLM and the
embedded server both serve; temperature 0 is greedy decoding. Each prompt's n samples also give ``mean@k``,
``pass@k`` and (when a reward function exposes ``extract_answer``) ``maj@k`` (``tasks/eval_metrics.py``).

These requests go straight to the server, beside the rollout worker: they never pass its staleness admission,
so evaluation takes nothing from the training's token allowance.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerError
from asyncgrpo.rollout.rewards import reward_function_name, run_reward_functions, total_rewards
from asyncgrpo.tasks.eval_metrics import answer_extractor, set_metrics

logger = logging.getLogger(__name__)

# asyncgrpo's own metric names (X7), beside the reference's METRICS (M1 in docs/spec.md).
EVAL_METRICS: dict[str, str] = {
    "eval/reward": "mean total reward of the eval_dataset completions (greedy unless eval_temperature > 0)",
    "eval/rewards/{reward_func_name}/mean": "one reward function's mean over the eval_dataset completions",
    "eval/completions/mean_length": "mean length of the eval_dataset completions",
    "eval/completions/clipped_ratio": "fraction of eval_dataset completions cut at max_completion_length",
    "eval/num_prompts": "prompts scored in the evaluation",
    "eval/mean@{k}": "mean total reward of each prompt's first k samples (k = 1, 2, 4, ... up to the samples drawn)",
    "eval/pass@{k}": "unbiased pass@k, 1 - C(n-c, k)/C(n, k) over n samples with c at or above pass_threshold",
    "eval/maj@{k}": "fraction of prompts whose most frequent answer among k samples passes (answer rewards only)",
    "eval/{set}/...": "the same figures for each named set of eval_datasets (eval/{set}/pass@{k}, ...)",
    "eval/{set}/rewards/{EnvClass}/mean": "agent sets: the environment's get_reward() mean over the set's episodes",
    "eval/{set}/tools/call_frequency": "agent sets: tool calls per episode",
    "eval/{set}/tools/failure_frequency": "agent sets: fraction of tool calls that failed (raised, unknown name, bad JSON)",
    "eval/{set}/tools/loop_exhausted_frac": "agent sets: fraction of episodes stopped at max_tool_calling_iterations",
    "eval/{set}/rollout/turns_mean": "agent sets: generation turns per episode",
}


@dataclass(frozen=True)
class EvalSettings:
    """How held-out prompts are sampled. ``temperature == 0``: greedy (one sample is enough)."""

    base_url: str
    max_tokens: int
    temperature: float = 0.0
    num_samples: int = 1
    concurrency: int = 64
    timeout: float = 600.0
    seed: int = 0
    chat_template_kwargs: dict[str, Any] | None = None
    top_k: int = 0  # sampled evaluation keeps the training top_k (a --return-sampling-mask server requires one)
    model: str | None = None  # the request's ``model``: None = the served model; adapter sync: the newest adapter
    pass_threshold: float = 1.0  # a sample passes (pass@k, maj@k) when its total reward is at least this
    max_tool_calling_iterations: int | None = None  # agent sets: executed tool-calling turns per episode (None: any)


def render(tokenizer: Any, prompt: list[dict[str, Any]], chat_template_kwargs: dict[str, Any] | None) -> list[int]:
    ids = tokenizer.apply_chat_template(
        prompt, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


async def _score_row(
    client: AsyncServerClient, tokenizer: Any, row: dict[str, Any], index: int, reward_funcs: list[Any], s: EvalSettings
) -> tuple[np.ndarray, np.ndarray, list[int], list[bool], list[str | None] | None]:
    params = {"max_tokens": s.max_tokens, "temperature": s.temperature, "n": s.num_samples, "seed": s.seed + index}
    if s.temperature > 0 and s.top_k > 0:
        params["top_k"] = s.top_k
    results = await client.complete_n(
        render(tokenizer, row["prompt"], s.chat_template_kwargs), params, timeout=s.timeout, model=s.model
    )
    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    extra = {k: [v] * len(results) for k, v in row.items() if k != "prompt"}
    per_func = await run_reward_functions(
        reward_funcs,
        prompts=[row["prompt"]] * len(results),
        completions=completions,
        completion_ids=[r.token_ids for r in results],
        reward_kwargs=extra,
    )
    lengths = [len(r.token_ids) for r in results]
    extract = answer_extractor(reward_funcs)
    answers = [extract(t) for t in texts] if extract is not None else None
    return per_func, total_rewards(per_func), lengths, [r.finish_reason == "length" for r in results], answers


async def evaluate_dataset(
    tokenizer: Any,
    dataset: Any,
    reward_funcs: list[Any],
    s: EvalSettings,
    prefix: str = "eval",
    progress: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Held-out reward, pass@k and completion figures, as ``{prefix}/reward`` etc.

    Args:
        progress: called once per scored prompt (``asyncgrpo eval``'s progress bar).

    Returns:
        ``{prefix}/reward`` (mean total reward over scored completions), ``{prefix}/rewards/{name}/mean``,
        ``{prefix}/completions/mean_length``, ``{prefix}/completions/clipped_ratio``, ``{prefix}/num_prompts``,
        and ``{prefix}/mean@k``, ``{prefix}/pass@k``, ``{prefix}/maj@k`` (``tasks/eval_metrics.set_metrics``).
    """
    gate = asyncio.Semaphore(s.concurrency)
    async with AsyncServerClient(s.base_url, max_connections=s.concurrency) as client:

        async def one(i: int) -> Any:
            async with gate:
                row = await _score_row(client, tokenizer, dataset[i], i, reward_funcs, s)
            if progress is not None:
                progress()
            return row

        try:
            rows = await asyncio.gather(*(one(i) for i in range(len(dataset))))
        except ServerError as e:
            if e.status == 400 and s.temperature == 0 and ("temperature" in e.message or "top_k" in e.message):
                raise ValueError(
                    f"the server at {s.base_url} refuses greedy requests ({e.message}): vLLM started with "
                    "--return-sampling-mask needs temperature > 0 and top_k > 0 on every request; set "
                    "eval_temperature > 0 (sampled evaluation keeps top_k), e.g. eval_temperature=0.6"
                ) from e
            raise
    per_func = np.concatenate([r[0] for r in rows]) if rows else np.empty((0, len(reward_funcs)))
    totals = np.concatenate([r[1] for r in rows]) if rows else np.empty(0)
    lengths = [n for r in rows for n in r[2]]
    clipped = [c for r in rows for c in r[3]]

    def mean(xs: np.ndarray) -> float:
        xs = xs[~np.isnan(xs)]
        return float(xs.mean()) if xs.size else math.nan

    out = {f"{prefix}/reward": mean(totals)}
    for j, func in enumerate(reward_funcs):
        out[f"{prefix}/rewards/{reward_function_name(func)}/mean"] = mean(per_func[:, j])
    out[f"{prefix}/completions/mean_length"] = float(np.mean(lengths)) if lengths else math.nan
    out[f"{prefix}/completions/clipped_ratio"] = float(np.mean(clipped)) if clipped else math.nan
    out[f"{prefix}/num_prompts"] = float(len(dataset))
    comparable = all(r[4] is not None for r in rows)
    k_metrics = set_metrics([list(r[1]) for r in rows], [r[4] for r in rows] if comparable else None, s.pass_threshold)
    out.update({f"{prefix}/{name}": value for name, value in k_metrics.items()})
    return out


def evaluate_sync(
    tokenizer: Any,
    dataset: Any,
    reward_funcs: list[Any],
    s: EvalSettings,
    prefix: str = "eval",
    progress: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Blocking ``evaluate_dataset`` (the trainer's main thread runs no event loop)."""
    return asyncio.run(evaluate_dataset(tokenizer, dataset, reward_funcs, s, prefix, progress))


def settings_from_config(args: Any, base_url: str | None = None) -> EvalSettings:
    """The eval sampling settings an ``AsyncGRPOConfig`` asks for."""
    return EvalSettings(
        base_url=base_url or args.server_urls[0],
        max_tokens=args.max_completion_length,
        temperature=args.eval_temperature,
        num_samples=args.eval_num_generations,
        concurrency=min(args.max_concurrent_rollouts, 64),
        timeout=args.vllm_server_timeout,
        seed=args.seed,
        chat_template_kwargs=args.chat_template_kwargs,
        top_k=args.top_k,
        pass_threshold=args.pass_threshold,
        max_tool_calling_iterations=args.max_tool_calling_iterations,
    )

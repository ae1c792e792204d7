"""Resolve the config against the probed server into the rollout worker's ``RolloutSettings``.

This is the one place where the worker's on/off decisions are taken from the config;
the worker then reads only the record (``rollout/settings.py``).
"""

from __future__ import annotations

import dataclasses
import math

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.config_data import pool_settings
from asyncgrpo.rollout.sampling import SamplingSettings
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.trainer.server_setup import ServerFacts


def config_extra_fields(args: AsyncGRPOConfig) -> dict[str, object]:
    """The fields an ``AsyncGRPOConfig`` subclass adds, by name (the rollout loop's ``self.config``)."""
    base = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.name not in base}


def build_rollout_settings(
    args: AsyncGRPOConfig, facts: ServerFacts, start_index: int, token_budget: int, eos_token_id: int | None
) -> RolloutSettings:
    """The worker's view of the run.

    Args:
        args: the run's config.
        facts: what the server reported at start (name, limits, capabilities).
        start_index: the first untrained prompt, counted over epochs (resume, T5).
        token_budget: tokens per row, resolved (``args.token_budget`` or the server's ``max_model_len``).
        eos_token_id: the tokenizer's end-of-sequence id, if any.
    """
    sampling = SamplingSettings(
        base_url=args.server_urls[0],
        base_urls=args.server_urls if len(args.server_urls) > 1 else (),
        max_model_len=facts.max_model_len,
        max_completion_length=args.max_completion_length,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        num_sampler_logprobs=args.num_sampler_logprobs if args.score_centering else None,
        kv_cache_tokens=facts.kv_cache_tokens,
        has_metrics=facts.has_metrics,
        masks_supported=facts.masks_supported,
        routed_experts=args.wants_routed_experts,  # MoE routing replay or its diagnosis
    )
    return RolloutSettings(
        model_name=facts.model_name,
        sampling=sampling,
        num_generations=args.num_generations,
        max_staleness=args.max_staleness,
        seed=args.seed,
        max_concurrent_rollouts=args.max_concurrent_rollouts,
        initial_tokens_per_step=token_budget * args.world_size * args.gradient_accumulation_steps,
        request_timeout_s=args.request_timeout,
        queue_maxsize=args.queue_maxsize,
        fork_threshold_tokens=args.fork_threshold_tokens,
        retry_for_s=args.vllm_server_restart_timeout,
        eos_token_ids=(eos_token_id,) if eos_token_id is not None else (),
        chat_template_kwargs=dict(args.chat_template_kwargs or {}),
        max_tool_calling_iterations=args.max_tool_calling_iterations,
        log_completions=args.log_completions,
        dataset_start_index=start_index,
        num_epochs=math.ceil(args.num_train_epochs) if args.max_steps <= 0 else None,
        sync_rollouts=args.sync_rollouts,
        answer_parse_processes=args.answer_parse_processes,
        scale_rewards=args.scale_rewards != "none",
        extra=config_extra_fields(args),
        prompt_pools=pool_settings(args) if args.prompt_pools else None,
        pass_threshold=args.pass_threshold,
    )

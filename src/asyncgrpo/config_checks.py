"""The cross-field checks of ``AsyncGRPOConfig`` (``config.py``) and the parsing of its JSON-dict fields.

``AsyncGRPOConfig.__post_init__`` calls ``config_problems`` once and reports every problem in one ``ValueError``,
each with what to change; keeping the rules here leaves ``config.py`` a readable list of fields. The checks take
the config as ``cfg`` and only read its fields: ``config.py`` imports this file, never the reverse.
"""

from __future__ import annotations

import json
from typing import Any

from asyncgrpo.config_data import data_problems
from asyncgrpo.config_loss import loss_field_problems
from asyncgrpo.config_moe import moe_replay_problems
from asyncgrpo.config_speed import speed_field_problems
from asyncgrpo.config_trl import resolve_trl_aliases

DTYPES = ("auto", "bfloat16", "float16", "float32")


def config_problems(cfg: Any) -> list[str]:
    """Every invalid value or combination of ``cfg`` (an ``AsyncGRPOConfig``), each with its fix."""
    p: list[str] = resolve_trl_aliases(cfg)  # first: an alias sets the field the checks below read
    if cfg.num_generations < 2:
        p.append(f"num_generations={cfg.num_generations}: need >= 2, advantages compare rollouts of a group")
    if cfg.max_completion_length < 1:
        p.append(f"max_completion_length={cfg.max_completion_length}: must be >= 1")
    if not cfg.temperature > 0:
        p.append(
            f"temperature={cfg.temperature}: must be > 0 (log-probs are computed from logits / temperature); "
            "use a small value such as 0.1 for near-greedy sampling"
        )
    if not 0 < cfg.top_p <= 1:
        p.append(f"top_p={cfg.top_p}: must be in (0, 1]; 1.0 disables top-p")
    if cfg.top_k < 0:
        p.append(f"top_k={cfg.top_k}: must be >= 0; 0 disables top-k")
    if cfg.min_p is not None and not 0 <= cfg.min_p <= 1:
        p.append(f"min_p={cfg.min_p}: must be in [0, 1] or None")
    needs_top_k = [name for name, on in (("top_p < 1", cfg.top_p < 1), ("min_p", bool(cfg.min_p))) if on]
    if needs_top_k and cfg.top_k == 0:
        p.append(
            f"{' and '.join(needs_top_k)} needs top_k > 0: the server caps the returned candidate set at top_k, "
            "and the trainer renormalises over that set (e.g. set top_k=512)"
        )
    if cfg.repetition_penalty <= 0:
        p.append(f"repetition_penalty={cfg.repetition_penalty}: must be > 0; 1.0 disables it")
    if cfg.max_tool_calling_iterations is not None and cfg.max_tool_calling_iterations < 1:
        p.append(f"max_tool_calling_iterations={cfg.max_tool_calling_iterations}: must be >= 1 or None")
    p += _server_url_problems(cfg)
    p += data_problems(cfg)
    for name in ("vllm_server_timeout", "vllm_server_connect_timeout", "rollout_worker_timeout"):
        if not getattr(cfg, name) > 0:
            p.append(f"{name}={getattr(cfg, name)}: must be > 0 seconds")
    if not cfg.vllm_server_restart_timeout >= 0:
        p.append(f"vllm_server_restart_timeout={cfg.vllm_server_restart_timeout}: must be >= 0 seconds")
    p += _loss_problems(cfg)
    p += loss_field_problems(cfg)
    p += _pipeline_problems(cfg)
    p += _unsupported_problems(cfg)
    p += moe_replay_problems(cfg)
    p += speed_field_problems(cfg)
    return p


def _server_url_problems(cfg: Any) -> list[str]:
    value = cfg.vllm_server_base_url
    if not isinstance(value, str | list | tuple):
        return [f"vllm_server_base_url={value!r}: must be a URL string or a list of URLs"]
    urls = cfg.server_urls
    p = [f"vllm_server_base_url: {u!r} must start with http:// or https://" for u in urls
         if not u.startswith(("http://", "https://"))]  # fmt: skip
    if not urls:
        p.append(f"vllm_server_base_url={value!r}: give at least one URL, e.g. 'http://localhost:8000'")
    if len(set(urls)) != len(urls):
        p.append(f"vllm_server_base_url={value!r}: lists a server twice; list each server once")
    return p


def _loss_problems(cfg: Any) -> list[str]:
    p: list[str] = []
    if not 0 <= cfg.epsilon < 1:
        p.append(f"epsilon={cfg.epsilon}: must be in [0, 1) so that 1 - epsilon > 0")
    if cfg.epsilon_high < 0:
        p.append(f"epsilon_high={cfg.epsilon_high}: must be >= 0")
    cmin, cmax = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if not 0 <= cmin < cmax:
        p.append(
            f"vllm_importance_sampling_clip_min={cmin} and vllm_importance_sampling_clip_max={cmax}: need "
            "0 <= clip_min < clip_max"
        )
    elif not cmin <= 1 <= cmax:
        p.append(
            f"[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]=[{cmin}, {cmax}] must "
            "contain 1.0, or even on-policy tokens (ratio 1) are excluded from the loss"
        )
    if cfg.score_centering and cfg.num_sampler_logprobs < 1:
        p.append(
            f"num_sampler_logprobs={cfg.num_sampler_logprobs}: score_centering needs >= 1 sampler top "
            "log-probs per token (default 8), or set score_centering=False"
        )
    elif cfg.num_sampler_logprobs < 0:
        p.append(f"num_sampler_logprobs={cfg.num_sampler_logprobs}: must be >= 0")
    if cfg.router_aux_loss_coef is not None and cfg.router_aux_loss_coef < 0:
        p.append(f"router_aux_loss_coef={cfg.router_aux_loss_coef}: must be >= 0 or None")
    if cfg.dtype not in DTYPES:
        p.append(f"dtype={cfg.dtype!r}: must be one of {', '.join(DTYPES)}")
    return p


def _pipeline_problems(cfg: Any) -> list[str]:
    p: list[str] = []
    if cfg.token_budget is not None and cfg.token_budget < 1:
        p.append(f"token_budget={cfg.token_budget}: must be >= 1, or None for the server's max_model_len")
    if cfg.activation_memory_budget is not None and not 0 <= cfg.activation_memory_budget <= 1:
        p.append(
            f"activation_memory_budget={cfg.activation_memory_budget}: must be in [0, 1] (the share of a layer's "
            "activations kept for the backward), or None for gradient_checkpointing as set"
        )
    if cfg.max_concurrent_rollouts < 1:
        p.append(f"max_concurrent_rollouts={cfg.max_concurrent_rollouts}: must be >= 1")
    if cfg.max_staleness < 0:
        p.append(f"max_staleness={cfg.max_staleness}: must be >= 0")
    if cfg.answer_parse_processes is not None and cfg.answer_parse_processes < 0:
        p.append(f"answer_parse_processes={cfg.answer_parse_processes}: must be >= 0, or None for the default")
    if cfg.weight_sync_topology not in ("per_server", "shared"):
        p.append(f"weight_sync_topology={cfg.weight_sync_topology!r}: must be 'per_server' or 'shared'")
    if cfg.weight_sync_backend not in ("auto", "ipc", "nccl", "gloo"):
        p.append(f"weight_sync_backend={cfg.weight_sync_backend!r}: must be 'auto', 'ipc', 'nccl' or 'gloo'")
    if cfg.weight_sync_steps < 1:
        p.append(f"weight_sync_steps={cfg.weight_sync_steps}: must be >= 1")
    if cfg.eval_temperature < 0 or cfg.eval_num_generations < 1:
        p.append(
            f"eval_temperature={cfg.eval_temperature}, eval_num_generations={cfg.eval_num_generations}: "
            "need temperature >= 0 (0.0 is greedy) and >= 1 generation"
        )
    if cfg.num_completions_to_print is not None and cfg.num_completions_to_print < 1:
        p.append(f"num_completions_to_print={cfg.num_completions_to_print}: must be >= 1 or None")
    if not cfg.ignore_data_skip:
        p.append(
            "ignore_data_skip=False: must be True; resume restarts the rollout worker at the first untrained "
            "prompt instead of replaying batches"
        )
    if cfg.remove_unused_columns:
        p.append("remove_unused_columns=True: must be False; every dataset column is passed to the reward functions")
    return p


def _unsupported_problems(cfg: Any) -> list[str]:
    p: list[str] = []
    if cfg.fp16 and cfg.bf16:
        p.append("fp16=True and bf16=True: choose one")
    if cfg.deepspeed:
        p.append("deepspeed is not supported: shard with FSDP2 instead (`fsdp`/`fsdp_config`, or accelerate launch)")
    if cfg.use_liger_kernel:
        p.append(
            "use_liger_kernel=True is not supported: the loss computes log-probs in chunks itself; set False "
            "(compile_decoder_layers=True fuses the norm, RoPE and activation kernels of the packed step instead)"
        )
    pc = getattr(cfg, "parallelism_config", None)
    for attr, what in (("cp_size", "context"), ("sp_size", "sequence")):
        size = getattr(pc, attr, 1) if pc is not None else 1
        if size is not None and size > 1:
            p.append(
                f"parallelism_config.{attr}={size}: {what} parallelism is not supported (rows are packed prefix "
                f"trees); use {attr}=1"
            )
    return p


def parse_json_dict(value: dict[str, Any] | str | None, name: str) -> dict[str, Any] | None:
    """Accept dicts passed as JSON strings on the command line."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}={value!r} is not valid JSON: {exc}; pass a dict or a JSON object string") from exc
    if not isinstance(parsed, dict):
        raise TypeError(f"{name}={value!r} must be a JSON object (a dict)")
    return parsed

"""Metric names, their window aggregation by name (M1, M2) and model FLOPs utilisation (M3).

A logging window is everything recorded since the previous log. Every value arrives as an event
`(name, value, weight)` and the window reduces each name by rules read off the name itself:

- names whose last part holds the word `count` are summed (events since the last log, not since start);
- otherwise names whose last part holds the word `max` / `min` keep the extreme value;
- everything else is a weighted mean. Producers choose the weight so the mean means what docs/metrics.md says:
  a per-rollout/sample/call mean is recorded with weight = number of items, a rate such as
  `rollout/generated_tokens_per_s` with weight = seconds (so the window gives total tokens / total seconds),
  and a once-per-step value with weight 1.

Units follow the suffix: `_s` seconds, `tokens_per_s` tokens per second, `_frac` a fraction in [0, 1],
`_per_step` a per-optimizer-step amount averaged over the window's steps.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from typing import Any

from asyncgrpo.step_times import slow_steps, warmup_share

__all__ = [
    "METRICS",
    "SERVER_METRICS",
    "STARTUP_METRICS",
    "MetricEvent",
    "MetricsWindow",
    "aggregation_rule",
    "flops_per_token",
    "is_documented_metric",
    "mfu",
    "peak_flops",
    "slow_steps",
    "unit_of",
    "warmup_share",
]

MetricEvent = tuple[str, float, float]  # (name, value, weight)

# ---------------------------------------------------------------------------------------------------------------
# Every metric name of the reference (M1 in docs/spec.md), with its meaning; docs/metrics.md is generated from it.
# `{reward_func_name}` / `{tool_name}` are templates.
METRICS: dict[str, str] = {
    "num_tokens": "prompt and completion tokens forwarded so far (shared prefixes counted once)",
    "completions/mean_length": "mean generated completion length (tool tokens excluded)",
    "completions/min_length": "shortest generated completion (tool tokens excluded)",
    "completions/max_length": "longest generated completion (tool tokens excluded)",
    "completions/mean_terminated_length": "mean length of completions that ended with EOS",
    "completions/min_terminated_length": "shortest completion that ended with EOS",
    "completions/max_terminated_length": "longest completion that ended with EOS",
    "completions/clipped_ratio": "fraction of completions whose last turn did not end with EOS (truncated)",
    "completions/duplicate_frac": "fraction of rollouts token-identical to an earlier rollout of their group",
    "tools/call_frequency": "mean tool calls per completion, over all rollouts (dropped groups included)",
    "tools/failure_frequency": "fraction of tool calls that failed (unknown tool or exception); NaN without calls",
    "rewards/{reward_func_name}/mean": "mean reward of one source over the completions it scored (dropped included)",
    "rewards/{reward_func_name}/group_std": "one source's within-group reward std, averaged over trained samples",
    "reward": "mean total reward over all scored completions, dropped groups included: the policy's reward",
    "reward_group_std": "within-group std of the total reward (the advantage divisor), averaged over trained samples",
    "reward_kept": "mean reward of the trained samples (dropped groups excluded)",
    "reward_dropped": "mean reward of the dropped groups, i.e. where they saturate",
    "frac_reward_zero_std": "fraction of groups dropped: zero reward std or fewer than two scorable completions",
    "sampling/sampling_logp_difference/mean": "mean |sampler log-prob - trainer log-prob| on trained tokens",
    "sampling/sampling_logp_difference/max": "max of that absolute difference",
    "sampling/importance_sampling_ratio/min": "smallest trainer/sampler ratio on trained tokens, before masking",
    "sampling/importance_sampling_ratio/mean": "mean of that ratio",
    "sampling/importance_sampling_ratio/max": "largest of that ratio",
    "sampling/masked_mean": "fraction of trained tokens the sampler correction gave weight 0 (their ratio, or their "
    "sequence's for sequence_mask, left [clip_min, clip_max]; [1/clip_max, clip_max] for icepop)",
    "sampling/truncated_mean": "fraction of trained tokens whose correction weight was clamped (token_truncate, "
    "sequence_truncate)",
    "sampling/sequence_ratio/mean": "sequence modes: mean over sequences of the product of their tokens' ratios",
    "sampling/sequence_ratio/max": "sequence modes: largest sequence ratio",
    "sampling/sequence_masked_mean": "sequence_mask: fraction of sequences the correction removed",
    "policy_ratio/mean": "TRL loss types: mean policy ratio pi_theta / pi_old (GSPO: the sequence ratio on each token)",
    "policy_ratio/max": "TRL loss types: largest policy ratio",
    "sampling/sampler_mass": "mean sampler probability mass covered by its num_sampler_logprobs top tokens",
    "entropy": "mean entropy of the token predictions on trained tokens",
    "aux_loss": "MoE load-balancing auxiliary loss, before scaling by router_aux_loss_coef",
    "moe/routing_mismatch/mean": "MoE, samples with routing: per layer the share of sampler-routed tokens whose "
    "experts in the trainer's forward differ from the sampler's top-k set, mean over layers (0 with router_replay)",
    "moe/routing_mismatch/max": "the same share in the worst layer",
    "moe/router_disagreement/mean": "per layer the share of those tokens whose trainer router's own top-k set "
    "differs from the sampler's (what router_replay overrides), mean over layers",
    "moe/router_disagreement/max": "the same share in the worst layer",
    "clip_ratio/region_mean": "fraction of trained tokens whose ratio is clipped by the trust region",
    "clip_ratio/low_mean": "fraction clipped at the lower bound (ratio < 1 - epsilon_low)",
    "clip_ratio/low_min": "per-completion minimum of the lower-bound clip fraction",
    "clip_ratio/high_mean": "fraction clipped at the upper bound (ratio > 1 + epsilon_high; cispo: weight capped at "
    "epsilon_high)",
    "clip_ratio/high_max": "per-completion maximum of the upper-bound clip fraction",
    "rollout/duration_s": "wall time of one rollout, from dispatch to collection",
    "rollout/generated_tokens_per_s": "generation throughput since the previous report",
    "rollout/concurrency": "rollouts running on the server at once",
    "rollout/concurrency_cap": "current cap on running rollouts, following server load",
    "rollout/turns_mean": "mean turns per rollout",
    "rollout/turns_max": "most turns in one rollout",
    "rollout/samples_per_rollout": "training samples per rollout (> 1: forks; < 1: rollouts with no trained token)",
    "rollout/fork_frac": "fraction of turn transitions whose prompt did not extend the held tokens (new sample)",
    "rollout/drift_tokens_mean": "held tokens a fork re-rendered, averaged over turn transitions (0 without fork)",
    "rollout/drift_tokens_max": "most held tokens re-rendered by one fork",
    "rollout/score_queue_size": "finished groups waiting to be scored",
    "rollout/queue_size": "scored samples waiting in the rollout queue, measured when the trainer pulls",
    "rollout/score_s": "time to score a group",
    "rollout/score_wait_s": "time a finished group waited before scoring",
    "rollout/score_block_s": "time generation was blocked because the scoring queue was full",
    "rollout/backpressure_s": "time generation waited for being max_staleness steps ahead of training",
    "rollout/vllm_retry_count": "generation requests retried",
    "rollout/vllm_kv_cache_usage_frac": "server KV-cache usage (max over engines), averaged over polls",
    "rollout/vllm_running_requests": "requests the server's engines are decoding (sum over engines)",
    "rollout/vllm_queued_requests": "requests accepted but not yet scheduled (sum over engines)",
    "rollout/vllm_preemption_count": "requests the server preempted (weight syncs preempt everything)",
    "tools/latency_s": "tool call execution time, all tools",
    "tools/{tool_name}/latency_s": "execution time of one tool's calls",
    "tools/{tool_name}/call_count": "calls of one tool",
    "tools/{tool_name}/failure_count": "failed calls of one tool",
    "tools/unknown_name_count": "calls to a tool that does not exist (a policy error)",
    "tools/parallel_calls_mean": "mean tool calls per assistant message that calls tools",
    "tools/loop_exhausted_frac": "fraction of rollouts stopped at max_tool_calling_iterations while still calling",
    "env/reset_s": "time in the environment's reset() before a rollout",
    "env/reward_s": "time in the environment's get_reward() after a rollout",
    "sample/forwarded_tokens_mean": "mean forwarded tokens per sample",
    "sample/forwarded_tokens_max": "most forwarded tokens in one sample",
    "sample/trained_tokens_mean": "mean trained tokens per sample",
    "sample/time_in_queue_s": "time a sample waited in the rollout queue before training",
    "sample/staleness_mean": "weight updates between the sampling policy and the training policy, mean",
    "sample/staleness_max": "largest staleness of a trained sample",
    "sample/dropped_stale_count": "samples dropped for exceeding max_staleness",
    "batch/forwarded_tokens_per_step": "tokens forwarded per step, all processes",
    "batch/trained_tokens_per_step": "tokens trained per step, all processes",
    "batch/samples_per_step": "samples per step",
    "batch/groups_per_step": "distinct groups per step",
    "batch/microbatches_per_step": "micro-batches per step",
    "batch/masked_token_frac": "fraction of forwarded tokens that are not trained",
    "batch/samples_per_row": "samples per packed row",
    "batch/row_tokens_mean": "mean forwarded tokens per row",
    "batch/row_tokens_max": "most forwarded tokens in one row",
    "batch/row_fill_frac": "fraction of token_budget a row uses",
    "batch/row_imbalance": "attention cost of the most expensive row over the mean (1.0: balanced)",
    "batch/packing_ratio": "tokens before packing per forwarded token (1.0: nothing shared)",
    "batch/pad_frac": "fraction of padding added to equalise row lengths (transfer only, stripped before forward)",
    "batch/dropped_oversize_count": "samples dropped for exceeding token_budget",
    "perf/step_s": "wall time of a step, optimizer, weight sync and sample wait included",
    "perf/fwd_bwd_s": "time in the step's forward and backward passes",
    "perf/fwd_s": "time in the forward passes only (on CUDA: GPU time between two events, no sync between the passes)",
    "perf/optimizer_s": "time in the optimizer step",
    "perf/rollout_wait_s": "time training waited on an empty rollout queue",
    "perf/weight_sync_s": "weight sync time (pause + barrier + transfer)",
    "perf/weight_sync_pause_s": "waiting for the server to pause",
    "perf/weight_sync_barrier_s": "waiting for the other processes",
    "perf/weight_sync_transfer_s": "transferring the weights",
    "perf/fwd_bwd_forwarded_tokens_per_s": "forwarded tokens per second of forward+backward",
    "perf/wall_clock_forwarded_tokens_per_s": "forwarded tokens per second of whole steps",
    "perf/wall_clock_trained_tokens_per_s": "trained tokens per second of whole steps",
    "perf/fwd_bwd_mfu": "model FLOPs utilisation over forward+backward (server excluded)",
    "perf/wall_clock_mfu": "model FLOPs utilisation over whole steps",
}

# Ours, beyond the reference (docs/spec.md): one set per generation server when the run has several (X5).
# `{server_index}` is the server's place in `vllm_server_base_url` (0, 1, ...); sent by the rollout worker's metrics
# poll.
SERVER_METRICS: dict[str, str] = {
    "rollout/server/{server_index}/request_count": "generation requests sent to this server",
    "rollout/server/{server_index}/error_count": "generation requests to this server that failed",
    "rollout/server/{server_index}/outstanding": "generation requests in flight on this server, averaged over polls",
    "rollout/server/{server_index}/kv_cache_usage_frac": "this server's KV-cache usage, averaged over polls",
    "rollout/server/{server_index}/weight_version": "the step whose weights this server reports on /weight_info",
    "rollout/server/{server_index}/alive": "1 while the run uses this server, 0 once it stopped answering and was "
    "dropped (its work moved to the others)",
}

# Ours (issue 41): where a run's first minutes go. Filled by trainer/warmup_stats.py; docs/metrics.md, "Start-up and
# warm-up", says when each is logged and how it is computed.
STARTUP_METRICS: dict[str, str] = {
    "perf/time_to_first_step_s": "seconds from the trainer process's start to the end of its first optimizer step "
    "(logged once)",
    "perf/server_ready_s": "the generation server's seconds from its process start to serving, from its /server_info "
    "(logged once; absent for servers that do not report it)",
    "perf/warmup_share": "share of the training time so far spent in steps slower than twice the median step "
    "(perf/step_s of every step so far)",
    "perf/recompiles": "torch.compile graphs built after the first step, a running total (logged when torch.compile "
    "is used)",
}

_PLACEHOLDERS = {r"\{reward_func_name\}": "[^/]+", r"\{tool_name\}": "[^/]+", r"\{server_index\}": "[0-9]+"}


def _template(name: str) -> re.Pattern[str]:
    pattern = re.escape(name)
    for placeholder, part in _PLACEHOLDERS.items():
        pattern = pattern.replace(placeholder, part)
    return re.compile("^" + pattern + "$")


def _data_metrics() -> dict[str, str]:
    """Dynamic sampling's and the prompt pools' names (issue 36), documented beside their code."""
    from asyncgrpo.rollout.dynamic_sampling import DYNAMIC_SAMPLING_METRICS
    from asyncgrpo.rollout.prompt_pools import POOL_METRICS

    return {**DYNAMIC_SAMPLING_METRICS, **POOL_METRICS}


_TEMPLATES = [_template(n) for n in (*METRICS, *SERVER_METRICS, *_data_metrics()) if "{" in n]


def is_documented_metric(name: str) -> bool:
    """Whether `name` is in the glossary: the reference's names (M1) or ours (templates filled with one path part)."""
    known = name in METRICS or name in STARTUP_METRICS or name in _data_metrics()
    return known or any(t.match(name) for t in _TEMPLATES)


def _last_words(name: str) -> list[str]:
    return name.rsplit("/", 1)[-1].split("_")


def aggregation_rule(name: str) -> str:
    """'sum', 'max', 'min' or 'mean', from the words of the name's last part (M2)."""
    words = _last_words(name)
    if "count" in words:
        return "sum"
    if "max" in words:
        return "max"
    if "min" in words:
        return "min"
    return "mean"


def unit_of(name: str) -> str | None:
    """Unit implied by the suffix: 'tokens/s', 's', 'fraction', 'per step', or None."""
    if name.endswith("tokens_per_s"):
        return "tokens/s"
    if name.endswith("_s"):
        return "s"
    if name.endswith("_frac"):
        return "fraction"
    if name.endswith("_per_step"):
        return "per step"
    return None


class MetricsWindow:
    """Accumulates metric events between two logs; `flush()` reduces them by name rules and starts a new window.

    NaN values are ignored (a window with only NaN for a name reports NaN, e.g. tools/failure_frequency without
    calls). Weights must be >= 0; a mean whose weights sum to 0 is NaN.
    """

    def __init__(self) -> None:
        self._acc: dict[str, list[float]] = {}  # name -> [a, b]: (sum w*v, sum w) | (sum, _) | (extreme, _)

    def add(self, name: str, value: float, weight: float = 1.0) -> None:
        """Record one value; `weight` is the number of items it averages (or the seconds of a rate)."""
        acc = self._acc.setdefault(name, [math.nan, 0.0])
        value = float(value)
        if math.isnan(value):
            return
        if weight < 0:
            raise ValueError(f"metric {name!r}: weight must be >= 0, got {weight}")
        rule = aggregation_rule(name)
        if rule == "mean":
            acc[0] = (0.0 if math.isnan(acc[0]) else acc[0]) + value * weight
            acc[1] += weight
        elif rule == "sum":
            acc[0] = (0.0 if math.isnan(acc[0]) else acc[0]) + value
        else:
            pick = max if rule == "max" else min
            acc[0] = value if math.isnan(acc[0]) else pick(acc[0], value)

    def add_ratio(self, name: str, numerator: float, denominator: float) -> None:
        """Record a rate/fraction so the window reports total numerator / total denominator."""
        if denominator > 0:
            self.add(name, numerator / denominator, denominator)
        else:
            self._acc.setdefault(name, [math.nan, 0.0])

    def extend(self, events: Iterable[MetricEvent]) -> None:
        """Record many `(name, value, weight)` events (e.g. the ones the rollout worker sends)."""
        for name, value, weight in events:
            self.add(name, value, weight)

    def __len__(self) -> int:
        return len(self._acc)

    def flush(self) -> dict[str, float]:
        """Reduce the window to one value per name and clear it."""
        out = {}
        for name, (a, b) in self._acc.items():
            if aggregation_rule(name) == "mean":
                out[name] = a / b if b > 0 and not math.isnan(a) else math.nan
            else:
                out[name] = a
        self._acc = {}
        return out


# ---------------------------------------------------------------------------------------------------------------
# MFU (M3). Dense bf16/fp16 tensor-core peaks in FLOP/s per device, from vendor datasheets (no sparsity).
# First substring match wins, so more specific names come first.
_PEAK_BF16: list[tuple[str, float]] = [
    ("GH200", 989e12),
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("RTX A6000", 155e12),
    ("RTX 4090", 165e12),
    ("A10", 125e12),
    ("MI325X", 1307e12),
    ("MI300X", 1307e12),
    ("MI250X", 383e12),
]
PEAK_FLOPS_ENV = "ASYNCGRPO_PEAK_FLOPS"


def peak_flops(device_name: str, dtype: str = "bfloat16", override: float | None = None) -> float | None:
    """Peak FLOP/s of one device at the training precision, or None when unknown.

    Args:
        device_name: e.g. `torch.cuda.get_device_name()`.
        dtype: Training compute dtype; only 'bfloat16'/'float16' have table entries.
        override: Explicit peak (FLOP/s); else the `ASYNCGRPO_PEAK_FLOPS` environment variable, else the table.
    """
    if override is None and os.environ.get(PEAK_FLOPS_ENV):
        override = float(os.environ[PEAK_FLOPS_ENV])
    if override is not None:
        return float(override)
    if dtype not in ("bfloat16", "float16", "bf16", "fp16"):
        return None
    for key, value in _PEAK_BF16:
        if key.lower() in device_name.lower():
            return value
    return None


_SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "qwen3_vl", "qwen3_vl_moe"}


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _is_sparse_layer(cfg: Any, layer: int) -> bool:
    if not _get(cfg, "num_experts", "num_local_experts", default=0):
        return False
    if layer in (_get(cfg, "mlp_only_layers", default=[]) or []):
        return False
    step = _get(cfg, "decoder_sparse_step", default=1) or 1
    return (layer + 1) % step == 0


def matmul_params_per_token(config: Any) -> int | None:
    """Parameters a token's forward multiplies through (active experts only, lm_head included), or None if unsupported."""
    model_type = getattr(config, "model_type", "")
    if model_type not in _SUPPORTED_MODEL_TYPES:
        return None
    cfg = getattr(config, "text_config", None) or config  # vision-language: the text tower does the work
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    nh = cfg.num_attention_heads
    nkv = _get(cfg, "num_key_value_heads", default=nh)
    hd = _get(cfg, "head_dim", default=h // nh)
    attn = h * nh * hd + 2 * h * nkv * hd + nh * hd * h  # q, k, v, o projections
    total = layers * attn + h * vocab  # lm_head
    for layer in range(layers):
        if _is_sparse_layer(cfg, layer):
            experts = _get(cfg, "num_experts", "num_local_experts")
            top_k = _get(cfg, "num_experts_per_tok", default=1)
            total += top_k * 3 * h * _get(cfg, "moe_intermediate_size", "intermediate_size") + h * experts
            shared = _get(cfg, "shared_expert_intermediate_size", default=0)
            total += 3 * h * shared + (h if shared else 0)
        else:
            total += 3 * h * cfg.intermediate_size  # gated MLP: gate, up, down
    return int(total)


def flops_per_token(config: Any, attended_keys: float) -> float | None:
    """Training FLOPs (forward + backward) per token: 6 * N_active + 12 * layers * heads * head_dim * keys.

    Args:
        config: The model's HF config (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Qwen3-VL).
        attended_keys: Mean number of keys a query attends to (about half the length for a causal sequence; the
            packer knows the exact count for tree-packed rows).

    Returns:
        FLOPs per trained-or-context token, or None for unsupported architectures (MFU is then not logged).
        Activation recomputation (gradient checkpointing) is not counted, as usual for MFU.
    """
    params = matmul_params_per_token(config)
    if params is None:
        return None
    cfg = getattr(config, "text_config", None) or config
    nh = cfg.num_attention_heads
    hd = _get(cfg, "head_dim", default=cfg.hidden_size // nh)
    return 6.0 * params + 12.0 * cfg.num_hidden_layers * nh * hd * attended_keys


def mfu(tokens: float, flops_per_tok: float, seconds: float, peak: float, num_devices: int = 1) -> float:
    """Achieved model FLOP/s over the peak of all training devices."""
    if seconds <= 0 or peak <= 0 or num_devices <= 0:
        return math.nan
    return tokens * flops_per_tok / (seconds * peak * num_devices)

"""Metric window rules (M2), the reference's metric names (M1 in docs/spec.md) and MFU (M3)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo.metrics import (
    METRICS,
    MetricsWindow,
    aggregation_rule,
    flops_per_token,
    is_documented_metric,
    matmul_params_per_token,
    mfu,
    peak_flops,
    unit_of,
)


def test_window_rules_on_a_hand_made_sequence():
    w = MetricsWindow()
    # per-item means: reward arrives per group as (group mean, number of scored completions)
    w.add("reward", 1.0, 3)  # 3 completions at mean 1.0
    w.add("reward", 0.0, 1)  # 1 completion at 0.0      -> (3 + 0) / 4 = 0.75
    # rate: 100 tokens in 2 s, then 500 tokens in 3 s -> 600 / 5 = 120 tokens/s (not mean(50, 166.7))
    w.add_ratio("rollout/generated_tokens_per_s", 100, 2.0)
    w.add_ratio("rollout/generated_tokens_per_s", 500, 3.0)
    # counts are summed since the last log
    w.add("sample/dropped_stale_count", 2)
    w.add("sample/dropped_stale_count", 3)
    w.add("tools/search/call_count", 4)
    # extremes
    w.add("sample/staleness_max", 1)
    w.add("sample/staleness_max", 4)
    w.add("sample/staleness_max", 2)
    w.add("completions/max_length", 17)
    w.add("completions/min_length", 9)
    w.add("completions/min_length", 3)
    w.add("clip_ratio/low_min", 0.2)
    w.add("clip_ratio/low_min", 0.1)
    # 'terminated' contains 'min' as letters, not as a word: this is a mean
    w.add("completions/mean_terminated_length", 10)
    w.add("completions/mean_terminated_length", 20)
    # everything else: mean of recorded values (one per step)
    w.add("perf/step_s", 1.0)
    w.add("perf/step_s", 3.0)
    # NaN is ignored; a name seen only with NaN reports NaN
    w.add("perf/step_s", float("nan"))
    w.add("tools/failure_frequency", float("nan"))
    m = w.flush()
    assert m["reward"] == pytest.approx(0.75)
    assert m["rollout/generated_tokens_per_s"] == pytest.approx(120.0)
    assert m["sample/dropped_stale_count"] == 5
    assert m["tools/search/call_count"] == 4
    assert m["sample/staleness_max"] == 4
    assert m["completions/max_length"] == 17
    assert m["completions/min_length"] == 3
    assert m["clip_ratio/low_min"] == pytest.approx(0.1)
    assert m["completions/mean_terminated_length"] == pytest.approx(15.0)
    assert m["perf/step_s"] == pytest.approx(2.0)
    assert math.isnan(m["tools/failure_frequency"])
    # the window restarts after a flush: counts are per window, not since the start
    assert len(w) == 0
    w.add("sample/dropped_stale_count", 1)
    assert w.flush() == {"sample/dropped_stale_count": 1}


def test_aggregation_rules_and_units_by_name():
    assert aggregation_rule("rollout/vllm_preemption_count") == "sum"
    assert aggregation_rule("sampling/importance_sampling_ratio/max") == "max"
    assert aggregation_rule("rollout/turns_max") == "max"
    assert aggregation_rule("batch/row_tokens_mean") == "mean"
    assert aggregation_rule("sampling/masked_mean") == "mean"
    assert unit_of("perf/wall_clock_trained_tokens_per_s") == "tokens/s"
    assert unit_of("rollout/score_wait_s") == "s"
    assert unit_of("rollout/vllm_kv_cache_usage_frac") == "fraction"
    assert unit_of("batch/samples_per_step") == "per step"
    assert unit_of("entropy") is None
    with pytest.raises(ValueError, match="weight must be >= 0"):
        MetricsWindow().add("reward", 1.0, -1)


def test_documented_metric_names():
    # a sample of the reference's list, including the templated names
    for name in (
        "num_tokens",
        "frac_reward_zero_std",
        "rewards/accuracy_reward/mean",
        "rewards/IncrementEnv/group_std",
        "tools/multiply/latency_s",
        "tools/multiply/failure_count",
        "perf/weight_sync_transfer_s",
        "batch/dropped_oversize_count",
        "sampling/sampler_mass",
        "clip_ratio/high_max",
    ):
        assert is_documented_metric(name), name
    assert not is_documented_metric("rewards/a/b/mean")
    assert not is_documented_metric("perf/made_up_s")
    assert len(METRICS) == 103 + 4  # the reference's names (templates once), + 6 of the loss families, + moe/*
    assert all(len(meaning) > 10 for meaning in METRICS.values())


def test_flops_per_token_matches_the_parameters_of_a_real_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    # independent reference: every Linear weight the token multiplies through (embedding lookup excluded)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params_per_token(cfg) == linear
    # 6N + 12 * layers * heads * head_dim * keys; head_dim = 16
    assert flops_per_token(cfg, attended_keys=10) == pytest.approx(6 * linear + 12 * 3 * 4 * 16 * 10)


def test_moe_counts_active_experts_only():
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=50,
        mlp_only_layers=[0],
    )
    attn = 32 * 32 + 2 * 32 * 16 + 32 * 32  # q, k, v (2 kv heads * 8), o
    dense_mlp = 3 * 32 * 64  # layer 0 is mlp-only
    moe = 2 * 3 * 32 * 16 + 32 * 8  # 2 active experts + router
    assert matmul_params_per_token(cfg) == 2 * attn + dense_mlp + moe + 32 * 50


def test_peak_flops_and_mfu():
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA GH200 480GB") == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3", dtype="float32") is None
    assert peak_flops("Some Future GPU") is None
    assert peak_flops("Some Future GPU", override=1e15) == 1e15
    # 1000 tokens * 1e12 FLOPs = 1e15 FLOPs in 2 s = 5e14 FLOP/s, over 2 devices * 1e15 FLOP/s -> 0.25
    assert mfu(1000, 1e12, 2.0, 1e15, num_devices=2) == pytest.approx(0.25)
    assert math.isnan(mfu(1000, 1e12, 0.0, 1e15))
    from transformers import GPT2Config

    assert flops_per_token(GPT2Config(), 10) is None  # unsupported architecture: MFU not logged


def test_per_server_metrics_are_documented_with_a_numeric_index():
    from asyncgrpo.metrics import SERVER_METRICS

    assert is_documented_metric("rollout/server/0/request_count")
    assert is_documented_metric("rollout/server/12/weight_version")
    assert not is_documented_metric("rollout/server/a/request_count")
    assert aggregation_rule("rollout/server/1/request_count") == "sum"
    assert aggregation_rule("rollout/server/1/outstanding") == "mean"
    assert len(SERVER_METRICS) == 6

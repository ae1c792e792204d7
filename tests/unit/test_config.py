"""AsyncGRPOConfig: the reference's parameters and defaults (T2 in docs/spec.md) and early, complete validation."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from transformers import HfArgumentParser, TrainingArguments

from asyncgrpo.config import AsyncGRPOConfig

# Transcribed from the reference's AsyncGRPOConfig signature (T2 in docs/spec.md).
DOCUMENT_DEFAULTS = {
    "model_init_kwargs": None,
    "dtype": "float32",
    "trust_remote_code": False,
    "router_aux_loss_coef": None,
    "num_generations": 8,
    "max_completion_length": 2048,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "chat_template_kwargs": None,
    "max_tool_calling_iterations": None,
    "vllm_server_base_url": "http://localhost:8000",
    "vllm_server_timeout": 1800.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "score_centering": True,
    "vllm_importance_sampling_clip_min": 0.5,
    "vllm_importance_sampling_clip_max": 5.0,
    "num_sampler_logprobs": 8,
    "token_budget": None,
    "max_concurrent_rollouts": 512,
    "max_staleness": 4,
    "weight_sync_steps": 1,
    "rollout_worker_timeout": 300.0,
    "log_completions": False,
    "num_completions_to_print": None,
}


def _config(**kwargs) -> AsyncGRPOConfig:
    return AsyncGRPOConfig(output_dir="/tmp/asyncgrpo-test-config", **kwargs)


def test_every_document_parameter_has_its_default_and_help():
    fields = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    for name, default in DOCUMENT_DEFAULTS.items():
        assert name in fields, name
        assert fields[name].default == default, name
        assert len(fields[name].metadata.get("help", "")) > 20, name


def test_changed_training_arguments_defaults():
    cfg = _config()
    assert cfg.logging_steps == 1
    assert cfg.learning_rate == 1e-6
    assert str(getattr(cfg.lr_scheduler_type, "value", cfg.lr_scheduler_type)) == "constant"
    assert cfg.ignore_data_skip is True
    assert cfg.remove_unused_columns is False
    assert cfg.gradient_checkpointing is True
    assert cfg.epsilon_high == cfg.epsilon == 0.2
    # bf16 is the default only where a bf16 accelerator exists; this CPU machine trains in fp32.
    bf16_ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    assert cfg.bf16 is bf16_ok
    assert _config(fp16=False, bf16=False).bf16 is False
    # The base class keeps its own defaults (sanity check that we compare against the right thing).
    base = {f.name: f.default for f in dataclasses.fields(TrainingArguments)}
    assert base["learning_rate"] == 5e-5 and base["logging_steps"] == 500


def test_gradient_checkpointing_can_be_turned_off():
    assert _config(gradient_checkpointing=False).gradient_checkpointing is False


def test_epsilon_high_explicit():
    assert _config(epsilon=0.1, epsilon_high=0.28).epsilon_high == 0.28


def test_all_problems_reported_together():
    with pytest.raises(ValueError) as info:
        _config(
            num_generations=1,
            top_p=0.9,
            min_p=0.05,
            vllm_importance_sampling_clip_min=2.0,
            vllm_importance_sampling_clip_max=1.5,
            num_sampler_logprobs=0,
            use_liger_kernel=True,
            deepspeed={"zero_optimization": {"stage": 2}},
            remove_unused_columns=True,
            ignore_data_skip=False,
            dtype="fp8",
        )
    text = str(info.value)
    assert "9 problem(s)" in text
    for needle in (
        "num_generations=1",
        "top_p < 1 and min_p needs top_k > 0",
        "clip_min < clip_max",
        "num_sampler_logprobs=0",
        "use_liger_kernel",
        "deepspeed is not supported",
        "remove_unused_columns=True",
        "ignore_data_skip=False",
        "dtype='fp8'",
    ):
        assert needle in text, needle


def test_top_p_with_top_k_is_fine():
    cfg = _config(top_p=0.95, top_k=512, min_p=0.05)
    assert cfg.top_p == 0.95 and cfg.top_k == 512


def test_clip_range_must_contain_one():
    with pytest.raises(ValueError, match="must contain 1.0"):
        _config(vllm_importance_sampling_clip_min=1.2)


def test_score_centering_off_allows_zero_sampler_logprobs():
    assert _config(score_centering=False, num_sampler_logprobs=0).num_sampler_logprobs == 0


def test_context_and_sequence_parallelism_rejected():
    from accelerate.parallelism_config import ParallelismConfig

    with pytest.raises(ValueError, match="cp_size=2: context parallelism"):
        _config(parallelism_config=ParallelismConfig(cp_size=2))
    if "sp_size" not in inspect.signature(ParallelismConfig).parameters:
        return  # accelerate before 1.12 (the declared floor is 1.10) has no sequence parallelism to refuse
    with pytest.raises(ValueError, match="sp_size=2: sequence parallelism"):
        _config(parallelism_config=ParallelismConfig(sp_size=2))


def test_temperature_and_url_checked():
    with pytest.raises(ValueError, match="temperature=0"):
        _config(temperature=0)
    with pytest.raises(ValueError, match="must start with http"):
        _config(vllm_server_base_url="localhost:8000")


def test_command_line_parsing_with_json_dicts():
    parser = HfArgumentParser(AsyncGRPOConfig)
    (cfg,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir",
            "/tmp/asyncgrpo-test-config",
            "--top_k",
            "50",
            "--top_p",
            "0.9",
            "--chat_template_kwargs",
            '{"enable_thinking": false}',
            "--model_init_kwargs",
            '{"revision": "main"}',
        ]
    )
    assert cfg.top_k == 50 and cfg.top_p == 0.9
    assert cfg.chat_template_kwargs == {"enable_thinking": False}
    assert cfg.model_init_kwargs == {"revision": "main"}
    with pytest.raises(ValueError, match="not valid JSON"):
        _config(chat_template_kwargs="{oops")


def test_subclass_may_add_fields():
    @dataclasses.dataclass
    class CurriculumConfig(AsyncGRPOConfig):
        pass_rate_cap: float = 0.9

    cfg = CurriculumConfig(output_dir="/tmp/asyncgrpo-test-config", pass_rate_cap=0.5)
    assert cfg.pass_rate_cap == 0.5 and cfg.num_generations == 8


def test_several_server_urls_as_list_comma_string_or_cli_words():
    assert _config().server_urls == ("http://localhost:8000",)  # one URL: as before
    urls = ("http://a:8000", "http://b:8001")
    assert _config(vllm_server_base_url=list(urls)).server_urls == urls
    assert _config(vllm_server_base_url=" http://a:8000/, http://b:8001 ").server_urls == urls
    parser = HfArgumentParser(AsyncGRPOConfig)
    for words in (["http://a:8000,http://b:8001"], ["http://a:8000", "http://b:8001"]):
        (cfg,) = parser.parse_args_into_dataclasses(["--output_dir", "/tmp/x", "--vllm_server_base_url", *words])
        assert cfg.server_urls == urls


def test_bad_server_url_lists_say_what_to_change():
    with pytest.raises(ValueError) as err:
        _config(vllm_server_base_url=["http://a:8000", "b:8001", "http://a:8000/"])
    assert "'b:8001' must start with http" in str(err.value)
    assert "lists a server twice" in str(err.value)
    with pytest.raises(ValueError, match="at least one URL"):
        _config(vllm_server_base_url=" , ")


def test_activation_memory_budget_is_a_share():
    assert _config(activation_memory_budget=0.5).activation_memory_budget == 0.5
    with pytest.raises(ValueError, match=r"activation_memory_budget=1.5: must be in \[0, 1\]"):
        _config(activation_memory_budget=1.5)


def test_tree_attention_backend_is_one_the_packer_knows():
    from asyncgrpo.config_speed import TREE_ATTENTION_BACKENDS
    from asyncgrpo.packing.attention import BACKENDS

    assert set(TREE_ATTENTION_BACKENDS) == set(BACKENDS)
    assert _config(tree_attention_backend="varlen").tree_attention_backend == "varlen"
    with pytest.raises(ValueError, match="tree_attention_backend='fast': must be one of auto, flex, varlen, sdpa"):
        _config(tree_attention_backend="fast")

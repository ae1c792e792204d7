"""The worker's RolloutSettings: built once from the config, decisions taken once, subclass knobs reachable."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from asyncgrpo import AsyncGRPOConfig, AsyncRolloutLoop
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.trainer.server_setup import ServerFacts
from asyncgrpo.trainer.worker_settings import build_rollout_settings

FACTS = ServerFacts(
    model_name="policy",
    max_model_len=512,
    kv_cache_tokens=8192,
    has_metrics=True,
    masks_supported=True,
    world_size=1,
    dtype=None,
    weight_backend=None,
)


@dataclasses.dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.config.pass_rate_cap > 0.5


def _config(tmp_path, cls=AsyncGRPOConfig, **kw):
    return cls(output_dir=str(tmp_path), report_to=[], **kw)


def test_settings_carry_the_config_values_resolved_against_the_server(tmp_path):
    args = _config(
        tmp_path,
        num_generations=6,
        max_staleness=3,
        seed=11,
        max_concurrent_rollouts=32,
        gradient_accumulation_steps=2,
        top_k=20,
        temperature=0.7,
        chat_template_kwargs={"enable_thinking": False},
        request_timeout=90,
        max_steps=5,
        answer_parse_processes=2,
    )
    st = build_rollout_settings(args, FACTS, start_index=7, token_budget=400, eos_token_id=2)
    assert st.answer_parse_processes == 2
    assert (st.model_name, st.num_generations, st.max_staleness, st.seed) == ("policy", 6, 3, 11)
    assert st.max_concurrent_rollouts == 32 and st.request_timeout_s == 90
    assert st.initial_tokens_per_step == 400 * 1 * 2  # token_budget × processes × accumulation steps
    assert st.eos_token_ids == (2,) and st.chat_template_kwargs == {"enable_thinking": False}
    assert st.dataset_start_index == 7 and st.num_epochs is None  # max_steps governs the run
    assert st.sampling.max_model_len == 512 and st.sampling.kv_cache_tokens == 8192
    assert st.sampling.wants_masks and st.sampling.use_generate_endpoint  # top_k truncates, the server masks
    assert st.extra == {}
    params = st.sampling.request_params(prompt_len=500, seed=1)
    assert params["max_tokens"] == 12 and params["top_k"] == 20 and params["temperature"] == 0.7
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.seed = 0  # type: ignore[misc]


def test_score_centering_is_decided_once_as_the_top_n(tmp_path):
    on = build_rollout_settings(_config(tmp_path, num_sampler_logprobs=5), FACTS, 0, 400, None)
    off = build_rollout_settings(
        _config(tmp_path, num_sampler_logprobs=5, score_centering=False, num_train_epochs=2.5), FACTS, 0, 400, None
    )
    assert on.num_sampler_logprobs == 5 and on.sampling.request_params(10, seed=1)["logprobs"] == 5
    assert off.num_sampler_logprobs is None and off.sampling.request_params(10, seed=1)["logprobs"] == 0
    assert off.num_epochs == 3 and off.eos_token_ids == ()


def test_config_subclass_fields_reach_the_loop_as_self_config(tmp_path):
    args = _config(tmp_path, cls=CurriculumConfig, pass_rate_cap=0.75)
    st = build_rollout_settings(args, FACTS, 0, 400, None)
    assert st.extra == {"pass_rate_cap": 0.75}
    loop = pickle.loads(pickle.dumps(CurriculumLoop(st, [], [], None)))  # it crosses the spawn by pickling
    assert loop.config.pass_rate_cap == 0.75 and loop.filter_prompt(0, {}, 0)
    with pytest.raises(AttributeError, match="self.settings"):
        _ = loop.config.temperature
    with pytest.raises(AttributeError, match="read-only"):
        loop.config.pass_rate_cap = 0.1


def test_bad_settings_are_refused_with_the_field_to_change(tmp_path):
    st = build_rollout_settings(_config(tmp_path), FACTS, 0, 400, None)
    with pytest.raises(ValueError, match="num_generations=1"):
        dataclasses.replace(st, num_generations=1)
    with pytest.raises(ValueError, match="initial_tokens_per_step=0"):
        dataclasses.replace(st, initial_tokens_per_step=0)
    with pytest.raises(TypeError, match="RolloutSettings"):
        AsyncRolloutLoop(_config(tmp_path), [], [], None)  # the config itself is no longer accepted
    assert isinstance(st, RolloutSettings)


def test_a_negative_answer_parse_processes_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"answer_parse_processes=-1: must be >= 0, or None for the default"):
        _config(tmp_path, answer_parse_processes=-1)

"""--generation-config: which sampling defaults the embedded server takes from generation_config.json (as vLLM)."""

from __future__ import annotations

import json

import pytest

from asyncgrpo.server.http.generation_defaults import load_generation_defaults
from asyncgrpo.server.http.protocol import ServerLimits, parse_completion, parse_generate


def _model(tmp_path, **config):
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **config}))
    return tmp_path


def test_auto_reads_the_sampling_fields_and_vllm_ignores_them(tmp_path):
    model = _model(tmp_path, temperature=0.6, top_k=20, top_p=0.95, repetition_penalty=1.1, min_p=None,
                   max_new_tokens=64, do_sample=True)  # fmt: skip
    auto = load_generation_defaults("auto", model)
    assert auto.sampling == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "repetition_penalty": 1.1}
    assert auto.max_new_tokens == 64
    neutral = load_generation_defaults("vllm", model)
    assert neutral.sampling == {} and neutral.max_new_tokens is None
    overridden = load_generation_defaults("vllm", model, {"temperature": 0.3})
    assert overridden.sampling == {"temperature": 0.3}
    assert load_generation_defaults("auto", tmp_path / "missing").sampling == {}  # no file: neutral


def test_penalties_the_engine_lacks_are_refused_at_start(tmp_path):
    with pytest.raises(ValueError, match="--generation-config vllm"):
        load_generation_defaults("auto", _model(tmp_path, presence_penalty=0.5))
    assert load_generation_defaults("auto", _model(tmp_path, frequency_penalty=0.0)).sampling == {}  # a no-op value


def _limits(**kw):
    return ServerLimits("m", max_model_len=100, vocab_size=1000, max_logprobs=20, return_sampling_mask=False,
                        lora_names=list, **kw)  # fmt: skip


def test_completions_fill_only_omitted_fields_and_generate_takes_max_new_tokens(tmp_path):
    limits = _limits(generation_defaults={"top_k": 20, "temperature": 0.6}, default_max_new_tokens=10)
    bare = parse_completion({"prompt": [1, 2], "max_tokens": 4}, limits, encode=list).requests[0].params
    assert (bare.top_k, bare.temperature, bare.max_tokens) == (20, 0.6, 4)
    explicit = parse_completion({"prompt": [1, 2], "max_tokens": 4, "top_k": 0, "temperature": 1.0}, limits,
                                encode=list).requests[0].params  # fmt: skip
    assert (explicit.top_k, explicit.temperature) == (0, 1.0)
    gen = parse_generate({"token_ids": [1, 2], "sampling_params": {}}, limits).requests[0].params
    assert (gen.top_k, gen.temperature, gen.max_tokens) == (0, 1.0, 10)  # /generate: neutral, max_new_tokens cap

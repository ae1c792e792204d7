"""``routed_experts`` on the wire, against what vLLM 0.33's code produces (real ``asyncgrpo serve`` processes).

vLLM 0.33 facts checked here (read from the ``vllm==0.33.0`` wheel):
- the flag is ``--enable-return-routed-experts`` (``vllm/engine/arg_utils.py: EngineArgs.add_cli_args``); it lands
  in ``vllm_config.aux_output_config.enable_return_routed_experts`` (``vllm/config/aux_output.py``: ``AuxOutputConfig``
  with ``max_bytes``), which ``/server_info?config_format=json`` dumps whole
  (``vllm/entrypoints/serve/dev/server_info/api_router.py: show_server_info``);
- each choice of ``/v1/completions`` and ``/inference/v1/generate`` has ``routed_experts``: ``numpy2base64`` of the
  array (``vllm/utils/serial_utils.py``; called in ``vllm/entrypoints/openai/completion/serving.py:
  OpenAIServingCompletion.request_output_to_completion_response`` and ``.../scale_out/token_in_token_out/
  serving.py``), null when the flag is off (``CompletionResponseChoice.routed_experts: str | None = None``);
- decoded with ``np.load(io.BytesIO(base64.b64decode(s)))`` it is ``[num_tokens - 1, num_layers, top_k]``, dtype
  uint8 for <= 256 experts (``routed_experts_capturer.py: RoutedExpertsCapturer.__init__``), rows from the request's
  ``routed_experts_prompt_start`` (``vllm/distributed/aux_output_connector/connector.py: take_output``), which must be
  in [0, prompt length] (``vllm/v1/engine/input_processor.py``: 400 otherwise; pydantic ``ge=0``).
The routing itself is checked against transformers' own router logits of the same tokens (``output_router_logits``).
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.assets import tiny_model_dir
from tests.helpers.raw_http import PROMPT, raw


@pytest.fixture(scope="module")
def moe_server(serve):
    return serve(tiny_model_dir("qwen3_moe"), "--max-model-len", "128", "--enable-return-routed-experts")


def _decode(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)))  # vLLM's documented recipe


def _reference_topk(model, tokens: list[int]) -> np.ndarray:
    """[len(tokens), layers, top_k] sorted top-k of the model's own router logits (transformers forward, fp32)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    per_layer = [torch.topk(logits.reshape(len(tokens), -1), k, dim=-1).indices for logits in out.router_logits]
    return np.sort(torch.stack(per_layer, dim=1).numpy(), axis=-1)


def test_completions_choices_carry_the_routing_of_prompt_and_output(moe_server):
    status, body = raw(moe_server.base_url, "POST", "/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 6, "n": 2, "seed": 3, "temperature": 1.0, "return_token_ids": True,
    })  # fmt: skip
    assert status == 200, body
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("qwen3_moe"), dtype=torch.float32)
    for choice in body["choices"]:
        routed = _decode(choice["routed_experts"])
        out = choice["token_ids"]
        assert routed.dtype == np.uint8  # 4 experts <= 256
        assert routed.shape == (len(PROMPT) + len(out) - 1, 2, 2)  # the last sampled token is never forwarded
        np.testing.assert_array_equal(np.sort(routed, axis=-1), _reference_topk(model, PROMPT + out[:-1]))


def test_generate_skips_the_prompt_start_and_refuses_a_start_past_the_prompt(moe_server):
    url = moe_server.base_url
    params = {"max_tokens": 5, "seed": 1, "temperature": 1.0}
    _, full = raw(url, "POST", "/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": params})
    _, tail = raw(url, "POST", "/inference/v1/generate", json={
        "token_ids": PROMPT, "sampling_params": {**params, "routed_experts_prompt_start": 3}})  # fmt: skip
    whole, part = _decode(full["choices"][0]["routed_experts"]), _decode(tail["choices"][0]["routed_experts"])
    assert full["choices"][0]["token_ids"] == tail["choices"][0]["token_ids"]  # same seed, same tokens
    assert len(whole) == len(PROMPT) + 5 - 1 and len(part) == len(whole) - 3
    np.testing.assert_array_equal(part, whole[3:])
    for start in (len(PROMPT) + 1, -1):
        status, body = raw(url, "POST", "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 2, "routed_experts_prompt_start": start})  # fmt: skip
        assert status == 400 and "routed_experts_prompt_start" in body["error"]["message"]
    _, info = raw(url, "GET", "/server_info")
    assert info["vllm_config"]["aux_output_config"] == {"enable_return_routed_experts": True, "max_bytes": None}


def test_a_dense_model_refuses_the_flag():
    from asyncgrpo.server.engine.engine import Engine

    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        Engine(str(tiny_model_dir("llama")), device="cpu", kv_cache_tokens=4096, enable_return_routed_experts=True)

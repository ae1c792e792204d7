"""The ``routed_experts`` wire format (``asyncgrpo/routed_experts.py``) against vLLM 0.33's: ``np.save`` bytes in
base64 (``vllm/utils/serial_utils.py: numpy2base64``), uint8 up to 256 experts else uint16
(``routed_experts_capturer.py``), null in a choice when the engine captures nothing; and the client's parsing."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

from asyncgrpo import routed_experts
from asyncgrpo.client.answer_parse import parse_choices
from asyncgrpo.errors import ServerError
from asyncgrpo.server.engine.request import RequestOutput
from asyncgrpo.server.http.protocol import (
    ParsedCompletion,
    ParsedRequest,
    completion_response,
    encode_json,
    generate_response,
)


def _vllm_numpy2base64(array: np.ndarray) -> str:
    """vLLM's encoder, restated: np.save without pickles into a buffer, standard base64, ASCII."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@pytest.mark.parametrize(("experts", "dtype"), [(8, np.uint8), (256, np.uint8), (257, np.uint16), (512, np.uint16)])
def test_encoding_and_dtype_match_vllm(experts, dtype):
    rng = np.random.default_rng(experts)
    array = rng.integers(0, experts, size=(7, 3, 2)).astype(routed_experts.routed_dtype(experts))
    assert array.dtype == dtype
    assert routed_experts.encode(array) == _vllm_numpy2base64(array)
    np.testing.assert_array_equal(routed_experts.decode(_vllm_numpy2base64(array)), array)
    # JSON bytes per token: base64 of layers * top_k ids, and the .npy header once
    assert len(routed_experts.encode(array)) == pytest.approx(
        7 * routed_experts.bytes_per_token(3, 2, experts), abs=200
    )


def test_answers_carry_the_field_on_both_endpoints_and_the_client_reads_it_back():
    routed = np.arange(24, dtype=np.uint8).reshape(4, 3, 2) % 8
    outs = [RequestOutput("r#0", [1, 2, 3], [5, 6], [-0.5, -0.25], "length", routed_experts=routed),
            RequestOutput("r#1", [1, 2, 3], [7, 8], [-0.5, -0.25], "length")]  # fmt: skip
    completion = completion_response(
        ParsedCompletion("c", "m", None, [1, 2, 3], [], 0, return_token_ids=True, return_tokens_as_token_ids=True),
        outs, lambda ids: "",
    )  # fmt: skip
    generate = generate_response(ParsedRequest("g", "m", None, [1, 2, 3], [], 0), outs)
    for kind, answer in (("completions", completion), ("generate", generate)):
        body = json.loads(encode_json(answer))
        assert body["choices"][0]["routed_experts"] == _vllm_numpy2base64(routed)
        assert body["choices"][1]["routed_experts"] is None  # present and null, as vLLM's pydantic models dump it
        parsed = parse_choices(encode_json(answer), kind, None)
        np.testing.assert_array_equal(parsed[0].routed_experts, routed)
        assert parsed[1].routed_experts is None


def test_a_malformed_field_is_a_server_error_naming_it():
    choice = {"index": 0, "token_ids": [5], "logprobs": None, "finish_reason": "length", "routed_experts": "bm90"}
    with pytest.raises(ServerError, match="routed_experts is not base64 .npy"):
        parse_choices(json.dumps({"choices": [choice]}).encode(), "generate", None)
    flat = _vllm_numpy2base64(np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match=r"\[tokens, layers, top_k\]"):
        routed_experts.decode(flat)

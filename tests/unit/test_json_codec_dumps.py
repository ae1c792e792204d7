"""``json_codec.dumps`` (request bodies) against the standard library's ``json.dumps``: the same JSON value."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asyncgrpo import json_codec

BODY = {
    "prompt": [151644, 872, 198, 0],
    "max_tokens": 256,
    "temperature": 1.0,
    "top_p": 0.95,
    "logprobs": 8,
    "seed": 2147483646,
    "stop": ["</answer>", "ünïcode ✓"],
    "logit_bias": {50256: -100.0},  # an int key: written as a string by both libraries
    "return_tokens_as_token_ids": True,
    "request_id": None,
}


@pytest.mark.parametrize("library", ["orjson", "json"])
def test_dumps_writes_what_json_dumps_writes(library, monkeypatch):
    if library == "orjson" and json_codec.orjson is None:
        pytest.skip("orjson is not installed")
    if library == "json":
        monkeypatch.setattr(json_codec, "orjson", None)
    out = json_codec.dumps(BODY)
    assert isinstance(out, bytes)
    assert json.loads(out) == json.loads(json.dumps(BODY))
    # What orjson refuses (an integer past 64 bits, a numpy float64) still goes out, as the standard library writes it.
    odd = {"seed": 2**70, "temperature": np.float64(0.5)}
    assert json.loads(json_codec.dumps(odd)) == {"seed": 2**70, "temperature": 0.5}
    with pytest.raises(TypeError):  # what neither library writes is refused, as before
        json_codec.dumps({"x": object()})

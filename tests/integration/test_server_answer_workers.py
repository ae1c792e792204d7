"""``asyncgrpo serve --answer-workers N``: large answers built in helper processes, same protocol.

One server with two helpers; a 300-token answer with ``logprobs=8`` (3,000 numbers, above the inline
threshold) goes through a helper. The reference is the same server's other endpoint for the same seed
(``/inference/v1/generate`` vs ``/v1/completions``: one engine, so the same tokens and log-probs) and
the protocol's own invariants (the sampled token is listed in its position's top log-probs).
"""

from __future__ import annotations

import pytest

from tests.helpers.procs import spawned_children
from tests.helpers.raw_http import raw

MAX_TOKENS = 300


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--answer-workers", "2", "--max-model-len", "512")


def test_large_answers_from_helpers_follow_the_protocol(server):
    params = {"max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0, "seed": 7,
              "logprobs": 8}  # fmt: skip
    status, comp = raw(server.base_url, "POST", "/v1/completions", json={
        "prompt": [1, 2, 3, 4], "return_tokens_as_token_ids": True, "return_token_ids": True, **params})  # fmt: skip
    assert status == 200, comp
    status, gen = raw(server.base_url, "POST", "/inference/v1/generate",
                      json={"token_ids": [1, 2, 3, 4], "sampling_params": params})  # fmt: skip
    assert status == 200, gen
    c, g = comp["choices"][0], gen["choices"][0]
    assert len(c["token_ids"]) == MAX_TOKENS and c["token_ids"] == g["token_ids"]
    content = g["logprobs"]["content"]
    assert c["logprobs"]["token_logprobs"] == [e["logprob"] for e in content]
    for tok, lp, top, entry in zip(c["token_ids"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"],
                                   content):  # fmt: skip
        assert top[f"token_id:{tok}"] == lp and entry["top_logprobs"][0] == {
            k: entry[k] for k in ("token_id", "logprob", "rank")
        }
        ranked = {f"token_id:{e['token_id']}": e["logprob"] for e in entry["top_logprobs"][1:]}
        assert len(ranked) == 8 and all(top[k] == v for k, v in ranked.items())
    assert "answer encoding in 2 helper processes" in server.log_tail(200_000)


@pytest.mark.long  # a scenario of half a minute on 2 cores: `make test-long`
def test_killed_helpers_cost_no_answer(server):
    """Every helper SIGKILLed between two requests: the next answer still comes, equal to the first (built in the
    server process or by a new helper), and the server says what happened."""
    import os
    import signal

    params = {"max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 1.0, "seed": 11,
              "logprobs": 8}  # fmt: skip
    body = {"prompt": [5, 6, 7], "return_tokens_as_token_ids": True, **params}
    status, first = raw(server.base_url, "POST", "/v1/completions", json=body)
    assert status == 200, first
    helpers = spawned_children(server.proc.pid)  # its answer helpers
    assert len(helpers) == 2, helpers
    for pid in helpers:
        os.kill(pid, signal.SIGKILL)
    for _ in range(2):  # the first may find the dead sockets, the second a fresh helper
        status, again = raw(server.base_url, "POST", "/v1/completions", json=body)
        assert status == 200, again
        assert again["choices"] == first["choices"]
    assert "lost an answer helper: pid" in server.log_tail(200_000)

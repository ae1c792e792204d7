"""The fault matrix's behaviours that already held before issue 9, kept as regression tests (real processes).

A killed worker and a raising reward function stop the run with a message naming them; malformed requests
leave the server healthy and reproducible; 300 concurrent requests are all answered.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from asyncgrpo.client.http_client import AsyncServerClient
from tests.integration.test_fault_matrix import _post

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--max-model-len", "256", "--kv-cache-tokens", "16384")


# A killed worker and a raising reward function: test_trainer_cpu.py's test_killed_worker_stops_the_trainer and
# test_raising_reward_function_stops_the_run_with_its_name check the same messages and time limits (in-process
# trainer, same SIGKILL of the worker), so the run-in-a-subprocess copies that were here are gone.


MALFORMED = [
    b"", b"{", b"null", b"[]", b"42", b'"x"', b"{}",
    {"token_ids": []}, {"token_ids": "abc"}, {"token_ids": [1.5]}, {"token_ids": [-1]}, {"token_ids": [10**9]},
    {"token_ids": [True]}, {"token_ids": [1], "sampling_params": []}, {"token_ids": [1], "sampling_params": "x"},
    {"token_ids": [1], "sampling_params": {"max_tokens": 0}}, {"token_ids": [1], "sampling_params": {"max_tokens": -5}},
    {"token_ids": [1], "sampling_params": {"max_tokens": "8"}}, {"token_ids": [1], "sampling_params": {"temperature": -1}},
    {"token_ids": [1], "sampling_params": {"temperature": "hot"}}, {"token_ids": [1], "sampling_params": {"top_p": 0}},
    {"token_ids": [1], "sampling_params": {"top_p": 1.5}}, {"token_ids": [1], "sampling_params": {"top_k": -2}},
    {"token_ids": [1], "sampling_params": {"min_p": 2}}, {"token_ids": [1], "sampling_params": {"n": 0}},
    {"token_ids": [1], "sampling_params": {"n": 10**6}}, {"token_ids": [1], "sampling_params": {"logprobs": 10**6}},
    {"token_ids": [1], "sampling_params": {"repetition_penalty": 0}},
    {"token_ids": [1], "sampling_params": {"stop_token_ids": [-3]}},
    {"token_ids": [1], "sampling_params": {"min_tokens": 99, "max_tokens": 2}},
    {"token_ids": [1], "sampling_params": {"presence_penalty": 1.0}}, {"token_ids": [1], "model": 7},
    {"token_ids": [1], "model": "no-such-model"}, {"token_ids": list(range(300))},
]  # fmt: skip


def test_malformed_requests_leave_the_server_healthy_and_reproducible(server):
    url = server.base_url + "/inference/v1/generate"
    good = {"token_ids": [3, 4, 5], "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 11}}
    status, before = _post(url, good)
    assert status == 200
    for body in MALFORMED:
        status, reply = _post(url, body)
        assert 400 <= status < 500, (body, status, reply)
        assert reply["error"]["message"], body
    assert urllib.request.urlopen(server.base_url + "/health", timeout=10).status == 200
    status, after = _post(url, good)
    assert status == 200 and after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]


def test_300_concurrent_requests_are_all_answered(server):
    async def main():
        async with AsyncServerClient(server.base_url, max_connections=300) as client:
            params = {"max_tokens": 2, "temperature": 1.0}
            return await asyncio.gather(*(client.generate([1, 2, i % 50 + 3], {**params, "seed": i})
                                          for i in range(300)))  # fmt: skip

    results = asyncio.run(main())
    assert len(results) == 300 and all(len(r.token_ids) >= 1 for r in results)
    info = json.loads(urllib.request.urlopen(server.base_url + "/load", timeout=10).read())
    assert info["server_load"] == 0

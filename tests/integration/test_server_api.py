"""Pause semantics, /metrics under load, client disconnects and bad inputs against a real server.

One server for the module: tiny Llama on CPU with ``--max-num-seqs 4`` (so requests
queue) and ``--max-model-len 1024`` (so a long request outlives a disconnect).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerError

PROMPT = [1, 504, 3032, 314, 260, 3241]
LONG = {"temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--max-num-seqs", "4", "--max-model-len", "1024")


async def _until(client, pred, what, timeout=30.0):
    """Poll /metrics until ``pred(metrics)``; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await client.metrics()
        if pred(m):
            return m
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}; last metrics {m}")


def _running(m):
    return m["vllm:num_requests_running"]


def test_pause_abort_finishes_in_flight_and_refuses_new_requests(server):
    async def go():
        async with AsyncServerClient(server.base_url) as c, AsyncServerClient(server.base_url, retries=0) as c0:
            tasks = [asyncio.create_task(c.generate(PROMPT, {**LONG, "max_tokens": 500, "seed": i})) for i in range(6)]
            await _until(c, lambda m: _running(m) > 0, "requests to run")
            await c.pause("abort")
            results = await asyncio.gather(*tasks)
            assert await c.is_paused()
            with pytest.raises(ServerError) as refused:
                await c0.generate(PROMPT, {"max_tokens": 2})
            await c.resume()
            assert not await c.is_paused()
            after = await c0.generate(PROMPT, {**LONG, "max_tokens": 3})
            return results, refused.value, after

    results, refused, after = asyncio.run(go())
    assert all(r.finish_reason == "abort" and len(r.token_ids) < 500 for r in results)
    assert all(len(r.logprobs) == len(r.token_ids) for r in results)
    assert refused.status == 503 and refused.retryable and "paused" in refused.message
    assert after.finish_reason == "length" and len(after.token_ids) == 3


def test_pause_wait_drains_in_flight_requests(server):
    async def go():
        async with AsyncServerClient(server.base_url) as c, AsyncServerClient(server.base_url, retries=0) as c0:
            tasks = [asyncio.create_task(c.generate(PROMPT, {**LONG, "max_tokens": 40, "seed": i})) for i in range(3)]
            # all three admitted first: a wait-mode pause drains the running requests; one still waiting would
            # stay queued until /resume (a loaded machine can admit them one step apart)
            await _until(c, lambda m: _running(m) == 3, "3 running requests")
            pause = asyncio.create_task(c.pause("wait"))
            while not await c.is_paused():  # the engine flags the pause at once, then drains
                await asyncio.sleep(0.005)
            with pytest.raises(ServerError) as refused:  # while draining, new requests are refused
                await c0.generate(PROMPT, {"max_tokens": 2})
            await pause
            at_pause = await c.metrics()
            results = await asyncio.gather(*tasks)
            await c.resume()
            return results, refused.value, at_pause

    results, refused, at_pause = asyncio.run(go())
    assert refused.status == 503
    assert _running(at_pause) == 0 and at_pause["vllm:num_requests_waiting"] == 0
    assert all(r.finish_reason == "length" and len(r.token_ids) == 40 for r in results)


def test_pause_keep_freezes_then_resumes(server):
    async def go():
        async with AsyncServerClient(server.base_url) as c:
            tasks = [asyncio.create_task(c.generate(PROMPT, {**LONG, "max_tokens": 300, "seed": i})) for i in range(3)]
            await _until(c, lambda m: _running(m) == 3, "3 running requests")
            await c.pause("keep")
            frozen = await c.metrics()
            queued = asyncio.create_task(c.generate(PROMPT, {**LONG, "max_tokens": 5}))  # queues, no 503
            await asyncio.sleep(0.4)
            later = await c.metrics()
            done_while_paused = [t.done() for t in [*tasks, queued]]
            await c.resume()
            return frozen, later, done_while_paused, await asyncio.gather(*tasks), await queued

    frozen, later, done_while_paused, results, queued = asyncio.run(go())
    assert later["vllm:generation_tokens_total"] == frozen["vllm:generation_tokens_total"]  # nothing generated
    # vLLM 0.33 (clear_cache=true, the default): the frozen requests are preempted, not aborted, and wait with
    # the new one; their KV is recomputed on resume.
    assert _running(later) == 0 and later["vllm:num_requests_waiting"] == 4
    assert not any(done_while_paused)
    assert all(r.finish_reason == "length" and len(r.token_ids) == 300 for r in results)
    assert queued.finish_reason == "length" and len(queued.token_ids) == 5


def test_metrics_under_load(server):
    n, max_tokens = 12, 40

    async def go():
        async with AsyncServerClient(server.base_url) as c:
            start = await c.metrics()
            tasks = [asyncio.create_task(c.generate(PROMPT, {**LONG, "max_tokens": max_tokens, "seed": i}))
                     for i in range(n)]  # fmt: skip
            busy = await _until(c, lambda m: _running(m) > 0 and m["vllm:num_requests_waiting"] > 0, "a queue")
            load = await c.load()
            await asyncio.gather(*tasks)
            return start, busy, load, await c.metrics(), await c.kv_cache_tokens()

    start, busy, load, end, kv_tokens = asyncio.run(go())
    assert _running(busy) <= 4  # --max-num-seqs
    assert 0 < busy["vllm:kv_cache_usage_perc"] <= 1
    assert load > 0
    assert _running(end) == 0 and end["vllm:num_requests_waiting"] == 0
    gen = end["vllm:generation_tokens_total"] - start["vllm:generation_tokens_total"]
    assert gen == n * max_tokens
    assert end["vllm:prompt_tokens_total"] - start["vllm:prompt_tokens_total"] >= n * len(PROMPT)
    assert end["vllm:num_preemptions_total"] >= 0
    assert kv_tokens is not None and kv_tokens >= 1024


def test_client_disconnect_aborts_the_request(server):
    async def go():
        async with AsyncServerClient(server.base_url) as c:
            start = await c.metrics()
            body = {"token_ids": PROMPT, "sampling_params": {**LONG, "max_tokens": 1000}}
            async with aiohttp.ClientSession() as s:
                with pytest.raises(asyncio.TimeoutError):
                    await s.post(server.base_url + "/inference/v1/generate", json=body,
                                 timeout=aiohttp.ClientTimeout(total=0.3))  # fmt: skip
            await _until(c, lambda m: _running(m) == 0, "the abandoned request to be aborted", timeout=20)
            await asyncio.sleep(0.2)
            return start, await c.metrics()

    start, end = asyncio.run(go())
    assert end["vllm:generation_tokens_total"] - start["vllm:generation_tokens_total"] < 1000


BAD_GENERATE = [
    ({"sampling_params": {"max_tokens": 2}}, "token_ids"),
    ({"token_ids": [], "sampling_params": {}}, "token_ids"),
    ({"token_ids": ["a"], "sampling_params": {}}, "token_ids"),
    ({"token_ids": [49152]}, "vocabulary"),
    ({"token_ids": [-1]}, "vocabulary"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": -1}}, "max_tokens"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "max_tokens"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": "5"}}, "max_tokens"),
    ({"token_ids": [1], "sampling_params": {"temperature": -0.5}}, "temperature"),
    ({"token_ids": [1], "sampling_params": {"top_p": 0.0}}, "top_p"),
    ({"token_ids": [1], "sampling_params": {"top_p": 1.5}}, "top_p"),
    ({"token_ids": [1], "sampling_params": {"top_k": -2}}, "top_k"),
    ({"token_ids": [1], "sampling_params": {"min_p": 2}}, "min_p"),
    ({"token_ids": [1], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"token_ids": [1], "sampling_params": {"n": 0}}, "n must"),
    ({"token_ids": [1], "sampling_params": {"logprobs": 21}}, "max-logprobs"),
    ({"token_ids": [1], "sampling_params": {"logprobs": -1}}, "logprobs"),
    ({"token_ids": [1], "sampling_params": {"stop_token_ids": "x"}}, "stop_token_ids"),
    ({"token_ids": [1], "sampling_params": {"seed": "a"}}, "seed"),
    ({"token_ids": [1], "sampling_params": {"presence_penalty": 0.5}}, "presence_penalty"),
    ({"token_ids": [1], "sampling_params": {"max_tokens": 2, "min_tokens": 3}}, "min_tokens"),
    ({"token_ids": [1], "sampling_params": [1, 2]}, "sampling_params"),
    ({"token_ids": [1], "stream": True}, "stream"),
    ([1, 2, 3], "JSON object"),
]


def test_bad_inputs_get_4xx_with_vllms_error_body_and_the_server_survives(server):
    url = server.base_url

    async def go():
        answers = []
        async with aiohttp.ClientSession() as s:

            async def send(method, path, **kw):
                async with s.request(method, url + path, **kw) as r:
                    answers.append((path, r.status, await r.json(content_type=None)))

            for body, _ in BAD_GENERATE:
                await send("POST", "/inference/v1/generate", json=body)
            await send(
                "POST", "/inference/v1/generate", data=b"{not json", headers={"Content-Type": "application/json"}
            )
            await send("POST", "/inference/v1/generate", json={"token_ids": [1], "model": "no-such-model"})
            await send("POST", "/v1/completions", json={"max_tokens": 2})
            await send("POST", "/v1/completions", json={"prompt": [[1], [2]], "max_tokens": 2})
            await send("POST", "/v1/completions", json={"prompt": [1], "max_tokens": -5})
            await send("POST", "/pause", params={"mode": "bogus"})
            await send("POST", "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/nope"})
            await send("GET", "/no/such/route")
            await send("GET", "/inference/v1/generate")
        async with AsyncServerClient(url, retries=0) as c:
            assert await c.health()
            ok = await c.generate(PROMPT, {**LONG, "max_tokens": 2})
        return answers, ok

    answers, ok = asyncio.run(go())
    expected = [400] * (len(BAD_GENERATE) + 1) + [404, 400, 400, 400, 400, 400, 404, 405]
    assert [a[1] for a in answers] == expected, answers
    for (path, status, body), (_, fragment) in zip(answers, [*BAD_GENERATE, *[(None, "")] * 9]):
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, (path, body)
        assert fragment in err["message"], (fragment, err["message"])
    assert answers[len(BAD_GENERATE) + 1][2]["error"]["type"] == "NotFoundError"
    assert ok.finish_reason == "length" and len(ok.token_ids) == 2


def test_basic_endpoints(server):
    async def go():
        async with AsyncServerClient(server.base_url) as c:
            return (await c.version(), await c.models(), await c.world_size(), await c.server_info(),
                    await c.supports_sampling_mask())  # fmt: skip

    version, models, world, info, masks = asyncio.run(go())
    assert version == "0.33.0"
    assert models[0]["max_model_len"] == 1024 and models[0]["object"] == "model"
    assert world == 1
    cfg = info["vllm_config"]
    assert cfg["model_config"]["max_model_len"] == 1024 and cfg["model_config"]["dtype"] == "torch.float32"
    assert cfg["cache_config"]["num_gpu_blocks"] * cfg["cache_config"]["block_size"] == cfg["cache_config"][
        "kv_cache_size_tokens"]  # fmt: skip
    assert cfg["weight_transfer_config"]["backend"] == "gloo"
    assert cfg["model_config"]["return_sampling_mask"] is False
    assert masks is False  # started without --return-sampling-mask
    ours = info["asyncgrpo"]  # the start (engine in this process: no engine-process phase); sums tile the times
    engine, http = ours["start_s"]["engine"], ours["start_s"]["http"]
    assert list(engine) == ["load", "kv", "sampler", "kernels", "graphs", "total"]
    assert list(http) == ["tokenizer", "imports", "engine", "app", "bind"]
    assert sum(http.values()) == pytest.approx(ours["ready_s"], abs=0.01) and ours["ready_s"] > engine["total"] > 0


def test_weight_transfer_endpoints_validate_before_any_collective(server):
    """The default ``--weight-transfer-checks vllm``: bad input is refused before any collective, with vLLM's 500
    and a message that names the problem; a start without a group is accepted, as vLLM accepts it."""

    async def go():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            await c.start_weight_update()  # no group yet: vLLM accepts it (its update would fail)
            await c.finish_weight_update(None)
            with pytest.raises(ServerError, match="unknown init_info keys") as bad_init:
                await c.init_weight_transfer_engine({"world_size": 2, "bogus": 1})
            assert bad_init.value.status == 500
            with pytest.raises(ServerError, match="master_address"):
                await c.init_weight_transfer_engine({"world_size": 2, "rank_offset": 1})
            with pytest.raises(ServerError, match="nccl"):
                await c.init_weight_transfer_engine({"world_size": 2, "rank_offset": 1, "nccl_unique_id_b64": "AAAA"})
            with pytest.raises(ServerError, match="call /start_weight_update first") as no_start:
                await c.update_weights({"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]})
            assert no_start.value.status == 500
            return await c.weight_info()

    assert asyncio.run(go()) == {"weight_version": "0"}

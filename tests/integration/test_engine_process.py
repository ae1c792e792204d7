"""The engine in its own process (``--engine-process on``, the default on CUDA) behind a real server.

References: a local HF forward of the same weights (greedy tokens and log-probs, fp32, 1e-4) before and after a
gloo weight update that the engine process receives; the server's own process id (the engine runs elsewhere);
and a SIGKILLed engine process, which must turn into errors that name it rather than hung requests.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerError
from asyncgrpo.server.launcher import ServerProcess
from asyncgrpo.weights.sender import WeightSender
from tests.helpers.reference import check_greedy, hf_model, perturb, server_greedy

PROMPT = [1, 504, 3032, 314, 260, 3241]


@pytest.fixture(scope="module")
def servers(serve, tiny_llama_dir) -> list[ServerProcess]:
    """Two engine-process servers started side by side (one wait instead of two); the second test kills its engine."""
    with ThreadPoolExecutor(2) as pool:
        return list(
            pool.map(lambda _: serve(tiny_llama_dir, "--max-model-len", "64", "--engine-process", "on"), range(2))
        )


async def _info(url: str) -> dict:
    async with AsyncServerClient(url) as c:
        return (await c.server_info())["asyncgrpo"]


def test_greedy_weights_pause_and_abort_through_the_engine_process(servers, tiny_llama_dir):
    server = servers[0]
    info = asyncio.run(_info(server.base_url))
    assert info["engine_pid"] != server.proc.pid  # the engine really runs in another process

    model = hf_model(tiny_llama_dir)
    check_greedy(model, server_greedy(server.base_url)[0])
    perturb(model, seed=5)
    sender = WeightSender(timeout_s=120, packed_buffer_size_bytes=256 * 1024)
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cpu")
    try:
        sender.update(model.named_parameters(), version="step-1")
    finally:
        sender.close()
    after, version = server_greedy(server.base_url)
    assert version == "step-1"
    check_greedy(model, after)  # the weights landed in the engine process

    async def pause_abort():
        async with AsyncServerClient(server.base_url) as c, AsyncServerClient(server.base_url, retries=0) as c0:
            long = {"temperature": 1.0, "ignore_eos": True, "max_tokens": 60}
            tasks = [asyncio.create_task(c.generate(PROMPT, {**long, "seed": i})) for i in range(3)]
            await asyncio.sleep(0.2)
            await c.pause("abort")
            results = await asyncio.gather(*tasks)
            with pytest.raises(ServerError) as refused:
                await c0.generate(PROMPT, {"max_tokens": 2})
            paused = await c.is_paused()
            await c.resume()
            again = await c.generate(PROMPT, {"max_tokens": 3, "ignore_eos": True})
            metrics = await c.metrics()
            return results, refused.value, paused, again, metrics

    results, refused, paused, again, metrics = asyncio.run(pause_abort())
    assert paused and refused.status == 503
    assert all(r.finish_reason in ("abort", "length") and len(r.logprobs) == len(r.token_ids) for r in results)
    assert len(again.token_ids) == 3
    assert metrics["vllm:generation_tokens_total"] >= sum(len(r.token_ids) for r in results) + 3


@pytest.mark.long  # a scenario of half a minute on 2 cores: `make test-long`
def test_a_killed_engine_process_fails_requests_and_health_with_its_exit_code(servers):
    server = servers[1]
    pid = asyncio.run(_info(server.base_url))["engine_pid"]

    async def kill_mid_request():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            task = asyncio.create_task(c.generate(PROMPT, {"max_tokens": 60, "ignore_eos": True, "temperature": 1.0}))
            await asyncio.sleep(0.1)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(ServerError) as failed:
                await asyncio.wait_for(task, 30)
            deadline = time.monotonic() + 30
            while await c.health() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return failed.value, await c.health()

    failed, healthy = asyncio.run(kill_mid_request())
    assert "engine process exited" in failed.message and str(-signal.SIGKILL) in failed.message
    assert not healthy


def _outputs(engine, requests) -> list:
    """Each request alone, one after another (the same batch shapes in both engines: the same float results)."""
    import queue

    outs = []
    for req in requests:
        box: queue.SimpleQueue = queue.SimpleQueue()
        engine.submit(req, box.put)
        outs.append(box.get(timeout=120))
    return outs


def test_outputs_cross_the_pipe_unchanged():
    """What the API process gets from the engine process equals what the engine hands out in process: the prompt
    (which no longer crosses the pipe), tokens, log-probs and top-N (one byte block), long answers and short ones."""
    from asyncgrpo.assets import tiny_model_dir
    from asyncgrpo.server.engine.engine import Engine
    from asyncgrpo.server.engine.process import RemoteEngine
    from asyncgrpo.server.engine.request import Request, SamplingParams
    from asyncgrpo.server.engine.settings import EngineSettings, ReceiverSettings

    model = str(tiny_model_dir("qwen3"))
    settings = EngineSettings(device="cpu", max_model_len=96, max_num_seqs=8)
    shapes = [(48, 8), (3, 8), (40, None), (48, 0)]  # (tokens, logprobs): packed top-N, pairs, none, none
    requests = []
    for i, (n, k) in enumerate(shapes):
        params = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, seed=i, logprobs=k)
        requests.append(Request(f"r{i}", [5 + i, 6, 7, 8, 9][: 2 + i], params))
    local = Engine(model, settings)
    local.start()
    try:
        want = _outputs(local, requests)
    finally:
        local.shutdown()
    remote = RemoteEngine(model, settings, ReceiverSettings(None, 60.0))
    try:
        got = _outputs(remote, requests)
    finally:
        remote.shutdown()
    for w, g in zip(want, got):
        assert g.prompt_token_ids == w.prompt_token_ids and g.prompt_token_ids  # restored from the request
        assert (g.token_ids, g.logprobs, g.finish_reason) == (w.token_ids, w.logprobs, w.finish_reason)
        if w.top_logprobs is None:
            assert g.top_logprobs is None
        else:
            assert list(g.top_logprobs) == list(w.top_logprobs)
    assert len(got[0].top_logprobs) == 48 and type(got[0].top_logprobs).__name__ == "PackedTop"
    assert type(got[1].top_logprobs) is list  # short: pairs, as before

"""The embedded server's general model path: families outside Llama/Mistral/Qwen2/Qwen3 run their HF forward.

For a Gated DeltaNet hybrid (Qwen3.5 text), a Qwen3-MoE model and a Qwen3-VL checkpoint served text-only, a
real ``asyncgrpo serve`` process (fp32, CPU) must give the greedy tokens and log-probs of a plain HF forward on
the same tokens (1e-4), for several concurrent requests; after a weight update over gloo, the outputs must
match the new weights. A VLM's update carries only its text-model weights (what the trainer sends).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.server.launcher import ServerProcess
from asyncgrpo.weights.sender import WeightSender
from tests.helpers.reference import check_greedy, hf_model, perturb, server_greedy

PROMPTS = [[1, 504, 3032, 314, 260, 3241], [12, 7, 900], [4000, 4001, 4002, 4003, 4004, 4005, 4006, 4007, 3]]


def _text_weights(model):
    """What the trainer sends: everything but a VLM's vision tower."""
    return [(n, p) for n, p in model.named_parameters() if not n.startswith("model.visual.")]


def _concurrent_greedy(base_url: str) -> list:
    async def go():
        async with AsyncServerClient(base_url, retries=0) as c:
            sp = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 2}
            return await asyncio.gather(*(c.generate(p, sp) for p in PROMPTS))

    return asyncio.run(go())


ARCHS = ["qwen3_5", "qwen3_moe", "qwen3_vl"]


@pytest.fixture(scope="module")
def servers(serve) -> dict[str, ServerProcess]:
    """One server per architecture, started side by side (one wait instead of three)."""
    dirs = [tiny_model_dir(arch) for arch in ARCHS]
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        started = pool.map(lambda d: serve(d, "--max-model-len", "64", "--max-num-seqs", "4"), dirs)
        return dict(zip(ARCHS, started, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_general_path_matches_hf_and_follows_weight_updates(servers, arch):
    model_dir = tiny_model_dir(arch)
    server = servers[arch]
    model = hf_model(model_dir)

    for prompt, result in zip(PROMPTS, _concurrent_greedy(server.base_url)):
        check_greedy(model, result, prompt)

    async def controls():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            await c.pause("keep")
            paused = await c.is_paused()
            await c.resume()
            return paused, await c.reset_prefix_cache()

    assert asyncio.run(controls()) == (True, True)  # nothing cached across requests: reset is a no-op success

    before, _ = server_greedy(server.base_url)
    perturb(model, seed=7)
    sender = WeightSender(timeout_s=120)
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cpu")
    try:
        sender.update(_text_weights(model), version="step-1")
    finally:
        sender.close()
    after, version = server_greedy(server.base_url)
    assert version == "step-1"
    assert after.token_ids != before.token_ids or after.logprobs != before.logprobs
    check_greedy(model, after)
    for prompt, result in zip(PROMPTS, _concurrent_greedy(server.base_url)):
        check_greedy(model, result, prompt)

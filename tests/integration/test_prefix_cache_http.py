"""Prefix caching through a real ``asyncgrpo serve`` process: GRPO groups over HTTP, counted from /metrics.

8 prompts x G=8 concurrent requests. Each prompt has 64 tokens = 4 full blocks
of 16, so by hand: the first request of a group admitted computes all 64
tokens, each of the other 7 shares 3 blocks, copies the first 15 tokens of the
4th and computes only the last token (63 reused) - in whatever order and step
the server admits them. A weight update and
``POST /reset_prefix_cache`` each make the next identical request miss.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.client.metrics_text import parse_prometheus_text
from asyncgrpo.weights.sender import WeightSender
from tests.helpers.reference import hf_model, perturb

G, NUM_PROMPTS, PROMPT_LEN = 8, 8, 64
PROMPTS = [[(31 * j + 7 * i) % 4000 + 10 for i in range(PROMPT_LEN)] for j in range(NUM_PROMPTS)]
PARAMS = {"temperature": 1.0, "max_tokens": 3, "ignore_eos": True}
COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "asyncgrpo:prefill_tokens_computed_total",
)


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--max-model-len", "128", "--max-num-seqs", "64", env={"VLLM_SERVER_DEV_MODE": "1"})


async def _counters(c: AsyncServerClient) -> dict[str, float]:
    text = await c.request("GET", "/metrics", parse="text")  # raw text: one counter is not a vllm: name
    values = {s.name: s.value for s in parse_prometheus_text(text) if s.name in COUNTERS}
    assert set(values) == set(COUNTERS), f"missing counters in /metrics: {set(COUNTERS) - set(values)}"
    return values


def _delta(end: dict[str, float], start: dict[str, float]) -> tuple[int, int, int]:
    return tuple(int(end[k] - start[k]) for k in COUNTERS)  # type: ignore[return-value]


def test_grpo_groups_share_their_prompt_blocks(server):
    async def go():
        async with AsyncServerClient(server.base_url) as c:
            start = await _counters(c)
            results = await asyncio.gather(*(c.generate(p, PARAMS) for p in PROMPTS for _ in range(G)))
            return start, await _counters(c), results

    start, end, results = asyncio.run(go())
    assert all(len(r.token_ids) == 3 for r in results)
    queries, hits, computed = _delta(end, start)
    unique = NUM_PROMPTS * PROMPT_LEN
    assert queries == NUM_PROMPTS * G * PROMPT_LEN
    assert hits == NUM_PROMPTS * (G - 1) * (PROMPT_LEN - 1)
    assert computed == queries - hits == unique + NUM_PROMPTS * (G - 1)
    assert computed <= 1.3 * unique


def _one(server, prompt) -> tuple[int, int, int]:
    async def go():
        async with AsyncServerClient(server.base_url) as c:
            start = await _counters(c)
            await c.generate(prompt, PARAMS)
            return _delta(await _counters(c), start)

    return asyncio.run(go())


def test_reset_and_weight_update_make_the_next_request_miss(server, tiny_llama_dir):
    prompt = PROMPTS[0]
    _one(server, prompt)
    assert _one(server, prompt)[1] == PROMPT_LEN - 1

    async def reset():
        async with AsyncServerClient(server.base_url) as c:
            return await c.reset_prefix_cache()

    assert asyncio.run(reset()) is True
    assert _one(server, prompt)[1] == 0
    assert _one(server, prompt)[1] == PROMPT_LEN - 1

    model = hf_model(tiny_llama_dir)
    perturb(model, seed=5)
    sender = WeightSender(timeout_s=120)
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cpu")
    try:
        sender.update(model.named_parameters(), version="step-1")
    finally:
        sender.close()
    assert _one(server, prompt)[1] == 0

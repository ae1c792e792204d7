"""A single-turn group goes out as one request for its G completions (``n`` = G), and they are the completions
that G single requests with the same seeds give.

A real worker process runs the default ``AsyncRolloutLoop`` against a real server; a reward function records each
scored group. The reference is the same server answering G single requests with the seeds of the group's
block (the server seeds choice i of an n-request with seed + i, as vLLM does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from transformers import AutoTokenizer

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.sampling import SamplingSettings
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.rollout.worker import RolloutWorker
from tests.helpers.loops import RequestRecordingLoop
from tests.helpers.rewards import recording_reward

G = 4
ROWS = [{"prompt": [{"role": "user", "content": f"Say {w}."}], "row": i} for i, w in enumerate(["yes", "no", "hi"])]


def _settings(base_url: str) -> RolloutSettings:
    sampling = SamplingSettings(base_url, max_model_len=512, max_completion_length=8, temperature=1.0,
                                num_sampler_logprobs=2)  # fmt: skip
    return RolloutSettings(model_name=None, sampling=sampling, num_generations=G, max_staleness=4, seed=0,
                           max_concurrent_rollouts=16, initial_tokens_per_step=10**6, num_epochs=1)  # fmt: skip


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir)


def _single_requests(base_url: str, sampling: SamplingSettings, prompt_ids: list[int], seeds: range) -> list:
    async def main() -> list:
        async with AsyncServerClient(base_url) as client:
            return [await client.complete(prompt_ids, sampling.request_params(len(prompt_ids), seed=s))
                    for s in seeds]  # fmt: skip

    return asyncio.run(main())


def test_a_group_is_one_request_with_the_completions_of_single_seeded_requests(server, tiny_llama_dir, tmp_path,
                                                                                monkeypatch):  # fmt: skip
    record = tmp_path / "groups.jsonl"
    monkeypatch.setenv("ASYNCGRPO_TEST_RECORD", str(record))  # the spawned worker inherits it
    settings = _settings(server.base_url)
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    loop = RequestRecordingLoop(settings, ROWS, [recording_reward], tok)
    w = RolloutWorker(loop, heartbeat_timeout=60)
    w.start()
    try:
        while not w.get_sample(timeout=60).end:
            pass
        w.check()
    finally:
        w.stop()
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [x["n"] for x in lines if "n" in x] == [G] * len(ROWS)  # one request per group, for its G choices
    groups = [x for x in lines if "row" in x]
    assert sorted(g["row"] for g in groups) == [0, 1, 2]
    used = []
    for g in groups:
        ids = g["completion_ids"]
        assert len(ids) == G and len({tuple(c) for c in ids}) == G  # G different completions: G different seeds
        rendered = tok.apply_chat_template(ROWS[g["row"]]["prompt"], add_generation_prompt=True, tokenize=True)
        prompt_ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
        # Group k (its place in the run) owns the block of seeds kG+1 .. kG+G (run seed 0).
        blocks = [range(k * G + 1, k * G + G + 1) for k in range(len(ROWS))]
        singles = {b.start: [r.token_ids for r in _single_requests(server.base_url, settings.sampling, prompt_ids, b)]
                   for b in blocks}  # fmt: skip
        match = [start for start, answers in singles.items() if answers == ids]
        assert len(match) == 1, f"row {g['row']}: {ids} is no block of single requests: {singles}"
        used += match
    assert sorted(used) == [k * G + 1 for k in range(len(ROWS))]  # every group its own block


class _OwnTurns(AsyncRolloutLoop):
    async def generate_one_turn(self, prompt_ids: list[int]):  # an override owns its requests
        return await super().generate_one_turn(prompt_ids)


def _eligible(loop: AsyncRolloutLoop, tools: list) -> bool:
    from asyncgrpo.rollout.agents.episode import AgentRuntime

    loop.agents = AgentRuntime(tools, None, None, lambda *a: None)
    return loop._group_as_one_request()


def test_only_default_single_turn_groups_go_as_one_request():
    settings = _settings("http://127.0.0.1:1")
    assert _eligible(AsyncRolloutLoop(settings, ROWS, [], None), [])
    assert not _eligible(AsyncRolloutLoop(settings, ROWS, [], None), [len])  # tools: multi-turn
    assert not _eligible(_OwnTurns(settings, ROWS, [], None), [])
    off = AsyncRolloutLoop(settings, ROWS, [], None)
    off.group_requests = False
    assert not _eligible(off, [])
    narrow = dataclasses.replace(settings, max_concurrent_rollouts=G - 1)  # G6: a group would run G at once
    assert not _eligible(AsyncRolloutLoop(narrow, ROWS, [], None), [])

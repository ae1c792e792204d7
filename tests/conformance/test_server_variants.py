"""vLLM behaviours that need a server started with particular flags (embedded server only; they skip against
a real vLLM): --return-sampling-mask, VLLM_SERVER_DEV_MODE unset, no --weight-transfer-config, and a model
whose generation_config.json sets sampling defaults. Each also checks that our client or trainer start-up
guards against the trap.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerError
from asyncgrpo.rollout.sampling import SamplingSettings
from asyncgrpo.server.launcher import ServerProcess
from asyncgrpo.trainer.server_setup import check_sampling_limits, check_weight_transfer, probe_server
from tests.helpers.raw_http import NEG_INF_WIRE, PROMPT, raw

MASK_MESSAGE = (
    "the server returns sampling masks, so every request needs top_k ≥ 1: set top_k, or restart vLLM without "
    "--return-sampling-mask"
)


# ---------------------------------------------------------------------- --return-sampling-mask


@pytest.fixture(scope="module")
def variant_servers(embedded, tiny_llama_dir, tmp_path_factory) -> dict[str, ServerProcess]:
    """The module's three embedded servers, started side by side (one wait instead of three).

    ``mask``: --return-sampling-mask; ``no_dev_mode``: VLLM_SERVER_DEV_MODE=0; ``genconfig``: a copy of the tiny
    model whose generation_config.json sets top_k 3 and repetition_penalty 1.3, started without weight transfer
    (vLLM's default).
    """
    model = tmp_path_factory.mktemp("genconfig") / "model"
    shutil.copytree(tiny_llama_dir, model)
    cfg = json.loads((model / "generation_config.json").read_text())
    cfg.update(top_k=3, repetition_penalty=1.3)
    (model / "generation_config.json").write_text(json.dumps(cfg))
    starts = {
        "mask": (tiny_llama_dir, ("--max-model-len", "128", "--return-sampling-mask"), None),
        "no_dev_mode": (tiny_llama_dir, ("--max-model-len", "64"), {"VLLM_SERVER_DEV_MODE": "0"}),
        "genconfig": (model, ("--max-model-len", "64", "--weight-transfer-config", '{"backend": "none"}'), None),
    }
    with ThreadPoolExecutor(len(starts)) as pool:
        started = {name: pool.submit(embedded, d, *flags, env=env) for name, (d, flags, env) in starts.items()}
        return {name: future.result() for name, future in started.items()}


@pytest.fixture(scope="module")
def mask_server(variant_servers):
    return variant_servers["mask"]


def test_sampling_mask_server_rejects_requests_without_top_k_or_temperature(mask_server):
    """v1/engine/input_processor.py: with --return-sampling-mask every request on every endpoint needs
    temperature > 0 and top_k > 0, else 400."""
    url = mask_server.base_url
    for path, body in [
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 1.0}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 1.0, "top_k": -1}),
        ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 1.0}}),
    ]:
        status, answer = raw(url, "POST", path, json=body)
        assert status == 400 and "top_k > 0" in answer["error"]["message"], (path, answer)
    status, answer = raw(url, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0,
                                                               "top_k": 5})  # fmt: skip
    assert status == 400 and "temperature > 0" in answer["error"]["message"]
    status, answer = raw(url, "POST", "/inference/v1/generate",
                         json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "temperature": 1.0,
                                                                        "top_k": 5}})  # fmt: skip
    assert status == 200 and all(len(m) <= 5 for m in answer["choices"][0]["sampling_mask"])


def test_trainer_start_refuses_top_k_0_against_a_masking_server(mask_server):
    """The guard: the probe reads model_config.return_sampling_mask and the start fails naming both fixes,
    instead of every rollout request failing part-way with a 400."""
    facts = probe_server(mask_server.base_url, 60, want_masks=False)
    assert facts.return_sampling_mask is True
    with pytest.raises(ValueError) as info:
        check_sampling_limits(facts, temperature=1.0, top_k=0, num_sampler_logprobs=0)
    assert MASK_MESSAGE in str(info.value)
    check_sampling_limits(facts, temperature=1.0, top_k=8, num_sampler_logprobs=0)  # fine with top_k set
    # ... and the request the worker builds for top_k=8 is accepted.
    settings = SamplingSettings(mask_server.base_url, max_model_len=128, max_completion_length=4, top_k=8)

    async def go():
        async with AsyncServerClient(mask_server.base_url, retries=0) as c:
            return await c.complete(PROMPT, settings.request_params(len(PROMPT), seed=1))

    assert len(asyncio.run(go()).token_ids) >= 1


def test_trainer_start_checks_temperature_and_max_logprobs(mask_server):
    facts = probe_server(mask_server.base_url, 60, want_masks=False)
    with pytest.raises(ValueError) as info:
        check_sampling_limits(facts, temperature=2.5, top_k=8, num_sampler_logprobs=facts.max_logprobs + 1)
    text = str(info.value)
    assert "temperature <= 2" in text and f"--max-logprobs {facts.max_logprobs + 1}" in text


# ---------------------------------------------------------------------- VLLM_SERVER_DEV_MODE


DEV_ROUTES = [("POST", "/pause"), ("POST", "/resume"), ("GET", "/is_paused"), ("GET", "/get_world_size"),
              ("GET", "/server_info"), ("POST", "/reset_prefix_cache"), ("GET", "/weight_info"),
              ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"),
              ("POST", "/update_weights"), ("POST", "/finish_weight_update")]  # fmt: skip


def test_without_dev_mode_rl_routes_are_bare_404s_and_the_client_says_what_to_set(variant_servers):
    """entrypoints/launchers/api_server/routers.py: RL and dev routes exist only with VLLM_SERVER_DEV_MODE=1."""
    server = variant_servers["no_dev_mode"]
    for method, path in DEV_ROUTES:
        assert raw(server.base_url, method, path)[0] == 404, path
    status, _body = raw(server.base_url, "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert status == 200  # generation still works

    async def go():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            with pytest.raises(ServerError) as info:
                await c.pause("keep")
            return info.value

    assert "VLLM_SERVER_DEV_MODE=1" in asyncio.run(go()).message
    with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
        probe_server(server.base_url, 60, want_masks=False)


# ---------------------------------------------------------------------- no weight transfer + generation config


@pytest.fixture(scope="module")
def genconfig_server(variant_servers):
    return variant_servers["genconfig"]


def _finite_per_position(choice) -> list[int]:
    return [sum(v > NEG_INF_WIRE for v in top.values()) for top in choice["logprobs"]["top_logprobs"]]


def test_completions_fill_omitted_fields_from_generation_config_but_not_our_clients(genconfig_server):
    """config/model.py get_diff_sampling_param + completion/protocol.py to_sampling_params: an omitted
    top_k comes from generation_config.json (3 survivors per position); the client sends every field."""
    url = genconfig_server.base_url
    status, bare = raw(url, "POST", "/v1/completions",
                       json={"prompt": PROMPT, "max_tokens": 4, "logprobs": 8, "seed": 0, "ignore_eos": True})  # fmt: skip
    assert status == 200
    assert _finite_per_position(bare["choices"][0]) == [3, 3, 3, 3]  # top_k=3 from the file
    status, explicit = raw(url, "POST", "/v1/completions",
                           json={"prompt": PROMPT, "max_tokens": 4, "logprobs": 8, "seed": 0, "ignore_eos": True,
                                 "top_k": 0})  # fmt: skip
    # an explicit 0 wins over the file: all 8 requested (plus the sampled token when it is not among them)
    assert all(n >= 8 for n in _finite_per_position(explicit["choices"][0]))

    async def go():
        async with AsyncServerClient(url, retries=0) as c:
            return await c.complete(PROMPT, {"max_tokens": 4, "logprobs": 8, "seed": 0, "ignore_eos": True})

    ours = asyncio.run(go())  # the client omitted top_k and repetition_penalty too, but sends the neutral values
    assert all(sum(v > NEG_INF_WIRE for v in top.values()) >= 8 for top in ours.top_logprobs)


def test_without_weight_transfer_config_the_routes_answer_500_and_the_client_says_what_to_add(genconfig_server):
    """v1/worker/gpu_worker.py: "Weight transfer not configured" (a RuntimeError, so HTTP 500)."""
    url = genconfig_server.base_url
    status, body = raw(url, "POST", "/init_weight_transfer_engine",
                       json={"init_info": {"rank_offset": 1, "world_size": 2, "master_address": "127.0.0.1",
                                           "master_port": 1}})  # fmt: skip
    assert status == 500 and "Weight transfer not configured" in body["error"]["message"]

    async def go():
        async with AsyncServerClient(url, retries=0) as c:
            with pytest.raises(ServerError) as info:
                await c.start_weight_update()
            return info.value

    assert """--weight-transfer-config '{"backend": "nccl"}'""" in asyncio.run(go()).message
    facts = probe_server(url, 60, want_masks=False)  # the probe reads it; only merged sync needs it (issue 26)
    assert facts.weight_transfer is False
    with pytest.raises(RuntimeError, match="--weight-transfer-config"):
        check_weight_transfer(facts, [url], adapter_sync=False)
    check_weight_transfer(facts, [url], adapter_sync=True)  # adapters only write files and call load_lora_adapter


def test_worker_says_shorten_the_prompts_only_for_a_length_400(mask_server):
    """The rollout worker reads the server's message: a rejected sampling setting is not reported as a prompt
    that is too long (before, every 400 was)."""
    from asyncgrpo.client.pool import ServerPool
    from asyncgrpo.rollout.loop import AsyncRolloutLoop
    from asyncgrpo.rollout.requests import Requester
    from asyncgrpo.rollout.settings import RolloutSettings
    from asyncgrpo.rollout.worker import RolloutWorker

    def loop_with(sampling: SamplingSettings) -> AsyncRolloutLoop:
        settings = RolloutSettings(model_name=None, sampling=sampling, num_generations=2, max_staleness=1, seed=0,
                                   max_concurrent_rollouts=1, initial_tokens_per_step=1)  # fmt: skip
        loop = AsyncRolloutLoop(settings, dataset=[], reward_funcs=[], processing_class=None)
        loop.channels = RolloutWorker(loop).channels  # the worker's real shared objects (the child is not started)
        return loop

    async def turn(settings: SamplingSettings, prompt: list[int]) -> str:
        loop = loop_with(settings)
        pool = ServerPool([mask_server.base_url], timeout=60, max_connections=1)
        ch = loop.channels
        loop.requester = Requester(loop.settings, pool, lambda: ch.policy_version.value, ch.dropped_server_mask)
        try:
            with pytest.raises(ValueError) as info:
                await loop.generate_one_turn(prompt)
        finally:
            await pool.close()
        return str(info.value)

    no_top_k = asyncio.run(turn(SamplingSettings(mask_server.base_url, 128, 4, top_k=0), PROMPT))
    assert "top_k > 0" in no_top_k and "Shorten" not in no_top_k
    # A prompt over the server's max_model_len (128) that the settings think fits: a length problem.
    too_long = asyncio.run(turn(SamplingSettings(mask_server.base_url, 4096, 4, top_k=8), [5] * 200))
    assert "Shorten the prompts" in too_long

"""Runtime LoRA through HTTP: a PEFT adapter made in the test must generate like the merged model.

Server: tiny Llama, fp32 on CPU, ``--enable-lora --max-lora-rank 8 --max-loras 2``.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerError
from tests.helpers.reference import PROMPT, check_greedy, hf_model, make_lora_adapter

GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 3}


@pytest.fixture(scope="module")
def setup(serve, tiny_llama_dir, tmp_path_factory):
    server = serve(tiny_llama_dir, "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", "--max-model-len", "64")
    root = tmp_path_factory.mktemp("adapters")
    merged1 = make_lora_adapter(tiny_llama_dir, root / "a1", seed=1)
    merged2 = make_lora_adapter(
        tiny_llama_dir, root / "a2", seed=2, targets=("k_proj", "o_proj", "gate_proj", "up_proj")
    )
    return server, root, hf_model(tiny_llama_dir), merged1, merged2


def test_adapter_output_equals_the_merged_model(setup):
    server, root, base, merged1, _ = setup

    async def go():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            await c.load_lora_adapter("a1", str(root / "a1"))
            cards = await c.models()
            # LoRA and base rows in flight together
            lora_out, base_out = await asyncio.gather(
                c.generate(PROMPT, GREEDY, model="a1"), c.generate(PROMPT, GREEDY)
            )
            return cards, lora_out, base_out

    cards, lora_out, base_out = asyncio.run(go())
    card = next(c for c in cards if c["id"] == "a1")
    assert card["parent"] == cards[0]["id"] and card["max_model_len"] is None and card["root"] == str(root / "a1")
    check_greedy(merged1, lora_out)
    check_greedy(base, base_out)
    assert lora_out.token_ids != base_out.token_ids


def test_load_errors_inplace_reload_and_unload(setup):
    server, root, _, _, merged2 = setup

    async def go():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            errors = {}
            if "a1" not in [m["id"] for m in await c.models()]:
                await c.load_lora_adapter("a1", str(root / "a1"))
            for key, call in {
                "clash": c.load_lora_adapter("a1", str(root / "a2")),
                "missing_path": c.request("POST", "/v1/load_lora_adapter", json_body={"lora_name": "x"}),
                "bad_path": c.load_lora_adapter("x", str(root / "does-not-exist")),
                "unknown_unload": c.unload_lora_adapter("never-loaded"),
            }.items():
                with pytest.raises(ServerError) as info:
                    await call
                errors[key] = info.value.status
            await c.load_lora_adapter("a1", str(root / "a2"), load_inplace=True)  # a1 now holds adapter 2
            replaced = await c.generate(PROMPT, GREEDY, model="a1")
            await c.unload_lora_adapter("a1")
            with pytest.raises(ServerError) as gone:
                await c.generate(PROMPT, GREEDY, model="a1")
            return errors, replaced, gone.value.status, [m["id"] for m in await c.models()]

    errors, replaced, gone_status, ids = asyncio.run(go())
    assert errors == {"clash": 400, "missing_path": 400, "bad_path": 400, "unknown_unload": 404}
    check_greedy(merged2, replaced)
    assert gone_status == 404
    assert "a1" not in ids


def test_rank_above_max_lora_rank_is_refused(setup, tiny_llama_dir):
    server, root, _, _, _ = setup
    make_lora_adapter(tiny_llama_dir, root / "rank16", seed=4, rank=16)

    async def go():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            with pytest.raises(ServerError) as info:
                await c.load_lora_adapter("r16", str(root / "rank16"))
            return info.value

    err = asyncio.run(go())
    assert err.status == 400 and "rank" in err.message

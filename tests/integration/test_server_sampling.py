"""Generation through HTTP against an independent computation in the test.

Two servers (tiny random-init Llama, fp32 on CPU), one with ``--return-sampling-mask``
for the requests that can carry masks (temperature > 0 and top_k > 0: vLLM refuses
any other request on such a server). The model's EOS id is set, before the servers
start, to the token greedy decoding produces third, so EOS stopping is observable.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerError
from tests.helpers.reference import PROMPT, TOL, hf_greedy, hf_model

MAX_MODEL_LEN = 48


@pytest.fixture(scope="module")
def setup(serve, tiny_llama_dir, tmp_path_factory):
    """(server, HF reference model, greedy continuation of PROMPT with the default EOS)."""
    from asyncgrpo.assets import tiny_model_dir

    greedy = hf_greedy(hf_model(tiny_llama_dir), PROMPT, 4)[0]
    assert greedy[2] not in greedy[:2]
    # Same seed and architecture -> same weights; only the EOS id differs.
    model_dir = tiny_model_dir("llama", tmp_dir=tmp_path_factory.mktemp("eos") / "m", eos_token_id=greedy[2])
    flags = [("--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"),
             ("--max-model-len", str(MAX_MODEL_LEN), "--return-sampling-mask", "--seed", "0")]  # fmt: skip
    with ThreadPoolExecutor(2) as pool:  # both start at once: one wait instead of two
        server, masking = pool.map(lambda f: serve(model_dir, *f), flags)
    return server, hf_model(model_dir), greedy, masking


def _post(url, path, body):
    async def go():
        async with AsyncServerClient(url, retries=0) as client:
            return await client.request("POST", path, json_body=body)

    return asyncio.run(go())


def _processed(logits, history, *, temperature, top_k=0, top_p=1.0, min_p=0.0, rep=1.0):
    """The processed distribution, written from vLLM's documented rules (float64)."""
    x = logits.double().clone()
    if rep != 1.0:
        ids = torch.tensor(sorted(set(history)))
        v = x[ids]
        x[ids] = torch.where(v > 0, v / rep, v * rep)
    if temperature == 0:
        return torch.log_softmax(x, -1)
    x = x / temperature
    if min_p > 0:
        p = torch.softmax(x, -1)
        x[p < min_p * p.max()] = -torch.inf
    if top_k > 0:
        kth = x.topk(top_k).values[-1]
        x[x < kth] = -torch.inf
    if top_p < 1.0:
        p = torch.softmax(x, -1)
        order = torch.argsort(p)  # ascending
        drop = torch.cumsum(p[order], 0) <= 1 - top_p
        drop[-1] = False  # the most probable token always stays
        x[order[drop]] = -torch.inf
    return torch.log_softmax(x, -1)


def _wire(v):
    return -torch.inf if v <= -9999.0 else v


CASES = [
    {"temperature": 0.7, "top_k": 40, "top_p": 0.8, "rep": 1.3},
    {"temperature": 0.3, "top_k": 100, "min_p": 0.9},
    {"temperature": 1.0, "top_k": 5},
    {"temperature": 0.0},
]


@pytest.mark.parametrize("case", CASES, ids=["topk-topp-rep", "minp", "topk", "greedy"])
def test_logprobs_top_n_and_masks_match_an_independent_computation(setup, case):
    plain, hf, _, masking = setup
    eligible = case["temperature"] > 0 and case.get("top_k", 0) > 0  # vLLM: masks need temperature > 0, top_k > 0
    server = masking if eligible else plain
    # Prepend high-ranked tokens so the repetition penalty changes the candidates.
    with torch.no_grad():
        first = hf(torch.tensor([PROMPT])).logits[0, -1].topk(6).indices.tolist()
    prompt = first + PROMPT
    n_top = 5
    sp = {"max_tokens": 6, "temperature": case["temperature"], "top_k": case.get("top_k", 0),
          "top_p": case.get("top_p", 1.0), "min_p": case.get("min_p", 0.0),
          "repetition_penalty": case.get("rep", 1.0), "seed": 11, "logprobs": n_top, "ignore_eos": True}  # fmt: skip
    body = _post(server.base_url, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": sp})
    choice = body["choices"][0]
    out = choice["token_ids"]
    assert len(out) == 6 and choice["finish_reason"] == "length"
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1 :]
    penalty_matters = False
    for i, entry in enumerate(choice["logprobs"]["content"]):
        ref = _processed(logits[i], prompt + out[:i], temperature=case["temperature"], top_k=case.get("top_k", 0),
                         top_p=case.get("top_p", 1.0), min_p=case.get("min_p", 0.0), rep=case.get("rep", 1.0))  # fmt: skip
        assert entry["token_id"] == out[i]
        assert abs(_wire(entry["logprob"]) - ref[out[i]].item()) <= TOL, (i, entry["logprob"], ref[out[i]].item())
        assert torch.isfinite(ref[out[i]])  # the sampled token is inside the candidate set
        assert entry["top_logprobs"][0]["token_id"] == out[i]  # sampled token first
        ranked = entry["top_logprobs"][1:]
        assert [e["rank"] for e in ranked] == list(range(1, n_top + 1))
        ref_top = ref.topk(n_top)
        for e, v, t in zip(ranked, ref_top.values.tolist(), ref_top.indices.tolist()):
            assert abs(_wire(e["logprob"]) - v) <= TOL or (v == -torch.inf and e["logprob"] == -9999.0)
            if v != -torch.inf:
                assert e["token_id"] == t
        mask = choice["sampling_mask"]
        if eligible:
            expected = set(torch.nonzero(torch.isfinite(ref)).flatten().tolist())
            assert set(mask[i]) == expected, i
            if case.get("rep", 1.0) != 1.0:
                unpenalized = _processed(logits[i], [], temperature=case["temperature"], top_k=case["top_k"],
                                         top_p=case.get("top_p", 1.0), min_p=case.get("min_p", 0.0))  # fmt: skip
                penalty_matters |= expected != set(torch.nonzero(torch.isfinite(unpenalized)).flatten().tolist())
        else:
            assert mask is None  # a server without --return-sampling-mask
    if case.get("rep", 1.0) != 1.0:
        assert penalty_matters, "the test prompt should make the repetition penalty change the candidates"
    assert choice["weight_versions"] == [{"version": "0", "start": 0, "end": 6}]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6, "total_tokens": len(prompt) + 6}


def test_seed_reproducibility_and_n(setup):
    server, _, _, masking = setup
    sp = {"max_tokens": 8, "temperature": 1.0, "ignore_eos": True}

    async def go():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            a = await c.generate(PROMPT, {**sp, "seed": 5})
            b = await c.generate(PROMPT, {**sp, "seed": 5})
            other = await c.generate(PROMPT, {**sp, "seed": 6})
            many = await c.generate_n(PROMPT, {**sp, "seed": 5, "n": 3})
            via_completions = await c.complete(PROMPT, {**sp, "seed": 5})
            assert not await c.supports_sampling_mask()
            async with AsyncServerClient(masking.base_url, retries=0) as m:
                assert await m.supports_sampling_mask()  # started with --return-sampling-mask
            return a, b, other, many, via_completions

    a, b, other, many, comp = asyncio.run(go())
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != other.token_ids
    assert len(many) == 3
    assert many[0].token_ids == a.token_ids and many[1].token_ids == other.token_ids  # seeds 5, 6, 7
    assert len({tuple(m.token_ids) for m in many}) == 3
    assert comp.token_ids == a.token_ids
    assert max(abs(x - y) for x, y in zip(comp.logprobs, a.logprobs)) <= TOL


def test_eos_stop_tokens_and_lengths(setup):
    server, hf, greedy, _ = setup
    eos = greedy[2]
    g = {"temperature": 0.0}

    async def go():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            return {
                "eos": await c.generate(PROMPT, {**g, "max_tokens": 10}),
                "ignore_eos": await c.generate(PROMPT, {**g, "max_tokens": 4, "ignore_eos": True}),
                "stop_id": await c.generate(PROMPT, {**g, "max_tokens": 10, "stop_token_ids": [greedy[1]]}),
                "min_tokens": await c.generate(PROMPT, {**g, "max_tokens": 10, "min_tokens": 5}),
                "to_limit": await c.generate(list(range(5, 5 + MAX_MODEL_LEN - 3)), {**g, "ignore_eos": True}),
                "one_left": await c.generate(list(range(5, 5 + MAX_MODEL_LEN - 1)), {**g, "max_tokens": 50}),
                "default16": await c.complete(PROMPT[:2], {**g, "ignore_eos": True}),
            }

    r = asyncio.run(go())
    assert r["eos"].token_ids == greedy[:3] and r["eos"].finish_reason == "stop" and r["eos"].stop_reason is None
    assert r["ignore_eos"].token_ids == greedy[:4] and r["ignore_eos"].finish_reason == "length"
    assert r["stop_id"].token_ids == greedy[:2] and r["stop_id"].finish_reason == "stop"
    assert r["stop_id"].stop_reason == greedy[1]
    assert len(r["min_tokens"].token_ids) >= 5 and eos not in r["min_tokens"].token_ids[:5]
    assert len(r["to_limit"].token_ids) == 3 and r["to_limit"].finish_reason == "length"  # max_tokens omitted
    assert len(r["one_left"].token_ids) == 1 and r["one_left"].finish_reason == "length"  # clamped
    assert len(r["default16"].token_ids) == 16  # /v1/completions' default max_tokens
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([PROMPT + greedy[:2]])).logits[0, len(PROMPT) - 1 :].double(), -1)
    for i, t in enumerate(greedy[:3]):
        assert abs(r["eos"].logprobs[i] - ref[i, t].item()) <= TOL


def test_completions_text_and_token_strings(setup):
    server, _, greedy, _ = setup
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server_model_dir(server))
    body = _post(server.base_url, "/v1/completions",
                 {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": 2})  # fmt: skip
    choice = body["choices"][0]
    assert choice["text"] == tok.decode(greedy[:2], skip_special_tokens=True)
    assert choice["logprobs"]["tokens"] == [tok.decode([t]) for t in greedy[:2]]
    assert choice["logprobs"]["text_offset"][0] == 0
    assert "token_ids" not in choice  # only with return_token_ids
    assert body["usage"]["completion_tokens"] == 2


def server_model_dir(server):
    """The model directory of a running server (its /v1/models root)."""

    async def go():
        async with AsyncServerClient(server.base_url) as c:
            return (await c.models())[0]["root"]

    return asyncio.run(go())


def test_prompt_at_max_model_len_is_rejected_with_vllms_error_body(setup):
    server, _, _, _ = setup

    async def go():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            assert await c.max_model_len() == MAX_MODEL_LEN
            for path in ("/inference/v1/generate", "/v1/completions"):
                prompt = list(range(5, 5 + MAX_MODEL_LEN))
                body = {"token_ids": prompt, "sampling_params": {"max_tokens": 1}} if "generate" in path else {
                    "prompt": prompt, "max_tokens": 1}  # fmt: skip
                with pytest.raises(ServerError) as info:
                    await c.request("POST", path, json_body=body)
                assert info.value.status == 400
                assert f"maximum context length is {MAX_MODEL_LEN}" in info.value.message

    asyncio.run(go())

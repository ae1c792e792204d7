"""The fast answer path on real server answers: orjson + float32-shortest numbers vs the standard library.

Two ``asyncgrpo serve`` processes on one tiny model: one with the default JSON library (orjson when installed)
and its engine in a process of its own (answers cross a pipe with their top-N packed into arrays), and one
in-process engine forced to the standard library (``ASYNCGRPO_JSON=stdlib``, which writes 9 significant digits with C's
printf instead of orjson's shortest float32 digits). The same seeded request to both must give the same tokens
and, at float32 (the engine's precision), the same log-probs: two independent number writers agree. On the
client, the array-backed parse (``TopLogprobs``) and the training arrays built from it must equal a reference
written here from ``json.loads`` position by position.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from asyncgrpo import json_codec
from asyncgrpo.client.results import TopLogprobs, parse_completion_choice
from asyncgrpo.rollout.reconcile import rollout_to_sequences
from asyncgrpo.types import Rollout, TurnRecord

TOKENS = 96
PROMPT = [1, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def servers(serve, tiny_llama_dir):
    with ThreadPoolExecutor(2) as pool:  # both start at once: one wait instead of two
        fast = pool.submit(serve, tiny_llama_dir, "--max-model-len", "256", "--engine-process", "on")  # top-N packed
        stdlib = pool.submit(serve, tiny_llama_dir, "--max-model-len", "256", env={"ASYNCGRPO_JSON": "stdlib"})
        return fast.result(), stdlib.result()


def _completion_bytes(base_url: str, seed: int, logprobs: int = 8) -> bytes:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "min_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0,
            "seed": seed, "logprobs": logprobs, "return_tokens_as_token_ids": True, "return_token_ids": True}  # fmt: skip
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return resp.read()


def _reference(choice: dict) -> tuple[list[int], list[float], list[dict[int, float]]]:
    """Token ids, log-probs and per-position ``{id: log-prob}`` read from the decoded JSON by hand."""
    lp = choice["logprobs"]
    tops = [{int(k.split(":", 1)[1]): float(v) for k, v in d.items()} for d in lp["top_logprobs"]]
    return choice["token_ids"], [float(v) for v in lp["token_logprobs"]], tops


def test_both_json_paths_serve_the_same_float32_values(servers):
    fast, stdlib = servers
    for seed in (3, 4):
        a, b = _completion_bytes(fast.base_url, seed), _completion_bytes(stdlib.base_url, seed)
        ids_a, lps_a, tops_a = _reference(json.loads(a)["choices"][0])
        ids_b, lps_b, tops_b = _reference(json.loads(b)["choices"][0])
        assert ids_a == ids_b and len(ids_a) == TOKENS
        assert np.array_equal(np.float32(lps_a), np.float32(lps_b))  # bit for bit at the engine's precision
        for da, db, tok in zip(tops_a, tops_b, ids_a):
            assert list(da) == list(db) and tok in da and len(da) in (8, 9)  # same ids, same order
            assert np.array_equal(np.float32(list(da.values())), np.float32(list(db.values())))
        if json_codec.orjson is not None:
            assert len(a) < len(b)  # the shortest float32 digits are never longer than 9 significant digits


def test_array_parse_and_training_arrays_equal_a_per_position_reference(servers):
    fast, _ = servers
    body = _completion_bytes(fast.base_url, seed=11)
    decoded = json_codec.loads(body)
    assert decoded == json.loads(body)  # orjson (when installed) and the stdlib decode the same answer alike
    choice = decoded["choices"][0]
    ids, lps, tops = _reference(json.loads(body)["choices"][0])
    res = parse_completion_choice(choice)
    assert isinstance(res.top_logprobs, TopLogprobs)
    assert res.token_ids == ids and res.logprobs == lps and list(res.top_logprobs) == tops and res.top_logprobs == tops
    assert res.top_logprobs[5] == tops[5] and res.top_logprobs[-2:] == tops[-2:]

    def sequences(top):
        turn = TurnRecord(prompt_ids=PROMPT, output_ids=ids, output_log_probs=lps, output_sampler_logprobs=top)
        (seq,) = rollout_to_sequences(Rollout(completion=[], completion_ids=ids, turns=[turn]), group_id=0,
                                      row_index=0, model_version=0, num_sampler_logprobs=4)  # fmt: skip
        seq.validate()
        return seq

    fast_seq, list_seq = sequences(res.top_logprobs), sequences(tops)  # arrays vs the per-position dict path
    assert fast_seq.sampler_top_ids.shape == (len(PROMPT) + TOKENS, 4)
    for i in range(len(PROMPT) + TOKENS):
        real = fast_seq.sampler_top_ids[i] >= 0
        assert fast_seq.sampler_top_ids[i][real].tolist() == list_seq.sampler_top_ids[i]
        assert fast_seq.sampler_top_logprobs[i][real].tolist() == np.float32(list_seq.sampler_top_logprobs[i]).tolist()
    best = [sorted(d.items(), key=lambda e: -e[1])[:4] for d in tops]  # by hand: the 4 best of each position
    assert [list_seq.sampler_top_ids[len(PROMPT) + i] for i in range(TOKENS)] == [[t for t, _ in b] for b in best]


def test_answer_parsing_helpers_give_the_inline_results_on_real_answers(servers):
    """The worker's client hands large answers to helper processes: same results as parsing on the loop."""
    import asyncio

    from asyncgrpo.client.answer_parse import AnswerParsers
    from asyncgrpo.client.http_client import AsyncServerClient

    fast, _ = servers
    params = {"max_tokens": TOKENS, "min_tokens": TOKENS, "ignore_eos": True, "temperature": 1.0, "logprobs": 8}

    async def main():
        parsers = AnswerParsers(2, min_bytes=0)
        try:
            assert await parsers.wait_ready()
            async with AsyncServerClient(fast.base_url, answer_parsers=parsers) as helped, \
                    AsyncServerClient(fast.base_url) as inline:  # fmt: skip
                # one request at a time on both: the same batch, so the same numbers from the engine
                got = [await helped.complete(PROMPT, {**params, "seed": s}) for s in (5, 6)]
                want = [await inline.complete(PROMPT, {**params, "seed": s}) for s in (5, 6)]
                return got, want, len(parsers._procs), helped.parse_seconds
        finally:
            await parsers.close()

    got, want, procs, loop_parse_s = asyncio.run(main())
    assert procs == 2 and loop_parse_s == 0.0  # the answers were parsed by the helpers, not on the loop
    for a, b in zip(got, want, strict=True):
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs) and len(a.token_ids) == TOKENS
        assert np.array_equal(a.top_logprobs.ids, b.top_logprobs.ids)
        assert np.array_equal(a.top_logprobs.values, b.top_logprobs.values)

"""The log-prob wire path: answers built as text (server/http/wire_json.py) and parsed back (client/results.py).

The reference is vLLM 0.33's nesting written out by hand below (one dict per position), so the
fast text must decode to exactly it; the time guard compares the build with the C encoder's cost
for the same numbers, the least any encoder of these answers pays.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import random
import time

import numpy as np
import pytest

from asyncgrpo.client.results import parse_completion_choice, parse_generate_choice
from asyncgrpo.rollout.reconcile import rollout_to_sequences
from asyncgrpo.server.engine.request import RequestOutput
from asyncgrpo.server.http.protocol import (
    ParsedCompletion,
    ParsedRequest,
    completion_response,
    encode_json,
    generate_response,
)
from asyncgrpo.server.http.wire_json import RawJSON, encode_with_raw
from asyncgrpo.types import Rollout, TurnRecord
from tests.helpers.answers import engine_output as _output
from tests.helpers.answers import float32_output as _float32_output
from tests.helpers.procs import pid_alive


def _wire(x: float) -> float | None:
    return None if math.isnan(x) else (-9999.0 if x == -math.inf else x)


def _reference_completion_logprobs(out: RequestOutput) -> dict:
    """vLLM's completions ``logprobs`` with return_tokens_as_token_ids, written out position by position."""
    tokens = [f"token_id:{t}" for t in out.token_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    tops = []
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        d = {f"token_id:{t}": _wire(v) for t, v in top}
        if f"token_id:{tok}" not in d:
            d[f"token_id:{tok}"] = _wire(lp)
        tops.append(d)
    return {"text_offset": offsets, "token_logprobs": [_wire(v) for v in out.logprobs], "tokens": tokens,
            "top_logprobs": tops}  # fmt: skip


def _reference_generate_content(out: RequestOutput) -> list[dict]:
    entries = []
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs):
        ranked = [{"token_id": t, "logprob": _wire(v), "rank": r} for r, (t, v) in enumerate(top, 1)]
        rank = next((e["rank"] for e in ranked if e["token_id"] == tok), None)
        if rank is None:
            rank = 1 + len([v for _, v in top if v > lp])
        sampled = {"token_id": tok, "logprob": _wire(lp), "rank": rank}
        entries.append({**sampled, "top_logprobs": [sampled, *ranked]})
    return entries


def _completion(outs: list[RequestOutput], logprobs: int = 8) -> dict:
    parsed = ParsedCompletion("cmpl-1", "m", None, [1, 2, 3], [], logprobs, return_token_ids=True,
                              return_tokens_as_token_ids=True, return_weight_versions=True)  # fmt: skip
    return json.loads(encode_json(completion_response(parsed, outs, lambda ids: "")))


def _generate(outs: list[RequestOutput], logprobs: int = 8) -> dict:
    parsed = ParsedRequest("gen-1", "m", None, [1, 2, 3], [], logprobs)
    return json.loads(encode_json(generate_response(parsed, outs)))


@pytest.mark.parametrize("k", [0, 1, 8])
def test_completion_logprobs_match_vllm_nesting_and_read_back_exactly(k):
    rng = random.Random(k)
    outs = [_output(rng, 40, k), _output(rng, 1, k, sampled_in_top=0.0), _output(rng, 0, k)]
    body = _completion(outs, logprobs=k)
    for out, choice in zip(outs, body["choices"]):
        assert choice["logprobs"] == _reference_completion_logprobs(out)
        assert choice["token_ids"] == out.token_ids and choice["prompt_token_ids"] == [1, 2, 3]
        parsed = parse_completion_choice(choice)
        assert parsed.token_ids == out.token_ids
        assert parsed.logprobs == out.logprobs  # 17 significant digits: the same doubles, bit for bit
        expected = [{t: v for t, v in top} | ({} if tok in dict(top) else {tok: lp})
                    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs)]  # fmt: skip
        assert parsed.top_logprobs == expected


@pytest.mark.parametrize("k", [0, 8])
def test_generate_content_matches_vllm_nesting(k):
    rng = random.Random(10 + k)
    outs = [_output(rng, 30, k), _output(rng, 5, k, sampled_in_top=1.0)]
    body = _generate(outs, logprobs=k)
    for out, choice in zip(outs, body["choices"]):
        assert choice["logprobs"]["content"] == _reference_generate_content(out)
        parsed = parse_generate_choice(choice)
        assert parsed.logprobs == out.logprobs and parsed.token_ids == out.token_ids
        # array-backed like the completions parse; the sampled token's repeat among the ranked ones counted once
        assert parsed.top_logprobs == [dict([(tok, lp), *top]) for tok, lp, top in
                                       zip(out.token_ids, out.logprobs, out.top_logprobs)]  # fmt: skip
        assert type(parsed.top_logprobs).__name__ == "TopLogprobs"


def test_non_finite_logprobs_go_out_as_vllm_numbers():
    """-inf -> -9999.0 and NaN -> null on both endpoints; the client reads -9999.0 back as -inf."""
    out = RequestOutput("r", [1], [5, 6], [-math.inf, -0.5], "length", None, [[(5, -math.inf)], [(7, math.nan)]])
    c = _completion([out], logprobs=1)["choices"][0]
    assert c["logprobs"] == _reference_completion_logprobs(out)
    assert c["logprobs"]["token_logprobs"] == [-9999.0, -0.5] and c["logprobs"]["top_logprobs"][1]["token_id:7"] is None
    g = _generate([out], logprobs=1)["choices"][0]
    assert g["logprobs"]["content"] == _reference_generate_content(out)
    assert parse_completion_choice(c).logprobs == [-math.inf, -0.5]


def test_raw_json_splices_only_its_own_placeholder():
    """Strings shaped like a placeholder stay strings; RawJSON text goes in verbatim, in order."""
    data = {"a": RawJSON('{"x":[1,2]}'), "b": "\x00raw-json-0:0", "c": [RawJSON("3.5"), "\\u0000", RawJSON("[]")]}
    assert json.loads(encode_with_raw(data)) == {"a": {"x": [1, 2]}, "b": "\x00raw-json-0:0",
                                                 "c": [3.5, "\\u0000", []]}  # fmt: skip


def _cpu_seconds(*fns, repeats: int = 7) -> list[float]:
    """Best CPU time of each function on this thread (other threads of the process do not count), measured in turns with the garbage collector off: a slow phase of a busy
    machine (another process on the core, a collection) then falls on every function alike, not on one of them."""
    best = [math.inf] * len(fns)
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            for i, fn in enumerate(fns):
                t0 = time.thread_time()
                fn()
                best[i] = min(best[i], time.thread_time() - t0)
    finally:
        if enabled:
            gc.enable()
    return best


def test_answer_build_is_linear_and_close_to_the_c_encoder():
    """N tokens x top-8: building + encoding the answer costs little more than json's C encoder pays for the same
    numbers alone, and 4x the tokens cost about 4x the time (no quadratic term). Measured 1.2x here and 1.7x on the
    CI machine (another CPU and Python build), so the bound is 2.5x: it catches a quadratic or per-token-object
    answer path, not a few tens of percent."""
    rng = random.Random(0)
    small, large = [_output(rng, 512, 8)], [_output(rng, 2048, 8)]
    parsed = ParsedCompletion("c", "m", None, [1], [], 8, return_token_ids=True, return_tokens_as_token_ids=True)

    def build(outs):
        return lambda: encode_json(completion_response(parsed, outs, lambda ids: ""))

    def numbers(outs):
        flat = [x for o in outs for tok, lp, top in zip(o.token_ids, o.logprobs, o.top_logprobs)
                for x in (tok, lp, lp, *(v for e in top for v in e))]  # fmt: skip
        return lambda: json.dumps(flat)

    t_small, t_large, floor = _cpu_seconds(build(small), build(large), numbers(large), repeats=11)
    assert t_large < 2.5 * floor, (
        f"answer build {t_large * 1e3:.1f} ms vs json.dumps of its numbers {floor * 1e3:.1f} ms"
    )
    assert t_large < 8.0 * t_small, f"4x tokens took {t_large / t_small:.1f}x the time"


def test_client_parse_and_reconcile_keep_the_sampler_top_n():
    """What the trainer receives: per trained token the top-N ids and log-probs, best first."""
    rng = random.Random(3)
    out = _output(rng, 64, 8)
    result = parse_completion_choice(_completion([out])["choices"][0])
    turn = TurnRecord(prompt_ids=[1, 2, 3], output_ids=result.token_ids, output_log_probs=result.logprobs,
                      output_sampler_logprobs=result.top_logprobs)  # fmt: skip
    (seq,) = rollout_to_sequences(Rollout(completion=[], completion_ids=result.token_ids, turns=[turn]), group_id=0,
                                  row_index=0, model_version=0, num_sampler_logprobs=8)  # fmt: skip
    # [L, 8] arrays (the client's answers are array-backed): prompt positions are padding (id -1, log-prob -inf)
    assert seq.sampler_top_ids.shape == seq.sampler_top_logprobs.shape == (3 + len(out.token_ids), 8)
    assert (seq.sampler_top_ids[:3] == -1).all() and (seq.sampler_top_logprobs[:3] == -np.inf).all()
    for i, top in enumerate(out.top_logprobs):
        assert seq.sampler_top_ids[3 + i].tolist() == [t for t, _ in top]
        assert seq.sampler_top_logprobs[3 + i].tolist() == [float(np.float32(v)) for _, v in top]  # float32 as trained
    seq.validate()


def test_validate_whole_list_checks_agree_with_the_position_loop():
    """TrainingSequence.validate checks whole lists first; a bad value still gets its position named."""
    from asyncgrpo.types import TrainingSequence

    def seq(**kw):
        base = {
            "input_ids": [1, 2, 3, 4],
            "loss_mask": [0, 0, 1, 1],
            "sampler_logprobs": [math.nan, 0.0, -0.5, -1.0],
            "advantage": 1.0,
            "model_version": 0,
            "group_id": 0,
            "row_index": 0,
            "sampler_top_ids": [[], [], [2, 3], [4]],
            "sampler_top_logprobs": [[], [], [-0.1, -0.5], [-1.0]],
        }
        return TrainingSequence(**{**base, **kw})

    seq().validate()  # untrained positions may hold anything (the NaN at 0 is context)
    with pytest.raises(ValueError, match=r"sampler_logprobs\[3\]=0.5 is not a log-probability"):
        seq(sampler_logprobs=[0.0, 0.0, -0.5, 0.5]).validate()
    with pytest.raises(ValueError, match=r"sampler_top_logprobs\[2\] holds a value"):
        seq(sampler_top_logprobs=[[], [], [-0.1, math.inf], [-1.0]]).validate()
    with pytest.raises(ValueError, match=r"sampler_top_ids\[3\] and sampler_top_logprobs\[3\] differ"):
        seq(sampler_top_logprobs=[[], [], [-0.1, -0.5], [-1.0, -2.0]]).validate()


def test_answers_built_in_a_helper_process_equal_the_inline_ones():
    """--answer-workers: the same bytes' JSON from a spawned helper as from the handler itself, both endpoints."""
    from asyncgrpo.server.http.answer_pool import AnswerEncoder

    rng = random.Random(5)
    outs = [_output(rng, 64, 8), _output(rng, 3, 8)]
    completion = ParsedCompletion("c", "m", None, [1, 2, 3], [], 8, return_token_ids=True,
                                  return_tokens_as_token_ids=True, return_weight_versions=True)  # fmt: skip
    generate = ParsedRequest("g", "m", None, [1, 2, 3], [], 8)

    def decode(ids: list[int]) -> str:
        return "text-" + "-".join(map(str, ids[:3]))

    async def main() -> tuple[list[bytes], list[bytes]]:
        inline, pooled = AnswerEncoder(0), AnswerEncoder(1, min_numbers=0)
        try:
            a = [await inline.completion(completion, outs, decode), await inline.generate(generate, outs)]
            b = [await pooled.completion(completion, outs, decode), await pooled.generate(generate, outs)]
            assert pooled.helper_pids()  # it really went to a helper
        finally:
            pooled.close()
        return a, b

    inline, pooled = asyncio.run(main())
    for x, y in zip(inline, pooled):
        dx, dy = json.loads(x), json.loads(y)
        dx.pop("created"), dy.pop("created")
        assert dx == dy
    assert json.loads(pooled[0])["choices"][0]["text"] == decode(outs[0].token_ids)


def test_a_killed_answer_helper_costs_no_answer_and_is_replaced():
    """A helper SIGKILLed between answers: the next answer still comes (inline, or from a new helper) with the
    same content, a new helper serves the one after; a job that fails in a helper is retried inline."""
    import operator
    import os
    import signal

    from asyncgrpo.server.http.answer_pool import AnswerEncoder

    rng = random.Random(6)
    outs = [_output(rng, 64, 8)]
    parsed = ParsedRequest("g", "m", None, [1, 2, 3], [], 8)

    async def main() -> tuple[list[bytes], list[int], list[int]]:
        enc = AnswerEncoder(1, min_numbers=0)
        try:
            first = await enc.generate(parsed, outs)
            before = enc.helper_pids()
            os.kill(before[0], signal.SIGKILL)
            deadline = time.monotonic() + 20
            while pid_alive(before[0]) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            second = await enc.generate(parsed, outs)
            third = await enc.generate(parsed, outs)
            after = enc.helper_pids()
            with pytest.raises(ZeroDivisionError):  # failed in the helper, then inline: the caller sees the error
                await enc._submit(operator.truediv, 1, 0)
            assert enc.helper_pids() == after  # a failed job does not cost the helper
            assert await enc._submit(lambda: b"inline") == b"inline"  # a job that does not pickle: built here
        finally:
            enc.close()
        return [first, second, third], before, after

    answers, before, after = asyncio.run(main())
    docs = [json.loads(a) for a in answers]
    for d in docs:
        d.pop("created")
    assert docs[0] == docs[1] == docs[2]
    assert after and after != before


def test_answer_helpers_carry_many_large_jobs_at_once_without_mixing_them():
    """More bytes in flight than a socket holds, both ways: the loop queues what the socket does not take and
    writes it when it drains, and cuts answers that span several reads back into the right jobs' bytes."""
    from asyncgrpo.server.http.answer_pool import AnswerEncoder

    rng = random.Random(7)
    payloads = [bytes(rng.choice(b"abcdefgh") for _ in range(64)) * (4096 + i) for i in range(24)]  # ~6 MB each way

    async def main() -> tuple[list[bytes], int]:
        enc = AnswerEncoder(2, min_numbers=0)
        try:
            answers = await asyncio.gather(*(enc._submit(bytes.upper, p) for p in payloads))
            return list(answers), len(enc.helper_pids())
        finally:
            enc.close()

    answers, helpers = asyncio.run(main())
    assert helpers == 2
    assert answers == [p.upper() for p in payloads]


def test_a_helper_that_keeps_a_job_too_long_is_killed_and_the_job_built_inline(monkeypatch, caplog):
    """A stuck helper (here: a job that sleeps) gets a line while it keeps the job, then is killed at the timeout;
    the job is built in the server process and a new helper serves the next one."""
    import operator

    from asyncgrpo.server.http import answer_pool

    monkeypatch.setattr(answer_pool, "LOG_EVERY_S", 0.2)
    monkeypatch.setattr(answer_pool, "HELPER_TIMEOUT_S", 0.7)

    async def main() -> tuple[object, float, list[int], list[int], object]:
        enc = answer_pool.AnswerEncoder(1, min_numbers=0)
        try:
            await enc._submit(operator.add, b"a", b"b")  # the helper is up
            stuck = enc.helper_pids()
            t0 = time.monotonic()
            result = await enc._submit(time.sleep, 0.9)  # 0.9 s in the helper; killed at 0.7 s, then 0.9 s inline
            took = time.monotonic() - t0
            return result, took, stuck, enc.helper_pids(), await enc._submit(operator.add, b"c", b"d")
        finally:
            enc.close()

    with caplog.at_level("INFO", logger="asyncgrpo.server.http.answer_pool"):
        result, took, stuck, after, next_answer = asyncio.run(main())
    assert result is None and next_answer == b"cd"
    assert 1.5 < took < 5.0  # the timeout, then the inline run; not the helper's sleep followed by its answer
    assert after == [] and not pid_alive(stuck[0])
    messages = [r.message for r in caplog.records]
    assert any("still waiting for answer helper pid" in m for m in messages)
    assert any("kept a job" in m and "killed it" in m for m in messages)


def test_helpers_that_keep_dying_leave_the_answers_to_the_server_process(monkeypatch, caplog):
    """Helpers lost three times in a row with no answer between (a helper that cannot start): the encoder stops
    starting new ones, says so once, and every answer (those in flight too) is still built, inline."""
    import socket
    import types

    from asyncgrpo.server.http import answer_pool

    started = []

    def dead_on_arrival(self: answer_pool._Helper, ctx: object) -> None:  # a helper whose process died at once
        self.sock, child = socket.socketpair()
        child.close()
        self.proc = types.SimpleNamespace(pid=-1 - len(started))
        started.append(self.proc.pid)
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        self.out, self.inbuf = bytearray(), bytearray()
        self.rbuf = bytearray(answer_pool.READ_CHUNK)
        self.rview = memoryview(self.rbuf)
        self.jobs = {}

    monkeypatch.setattr(answer_pool._Helper, "__init__", dead_on_arrival)
    rng = random.Random(8)
    outs = [_output(rng, 64, 8)]
    parsed = ParsedRequest("g", "m", None, [1, 2, 3], [], 8)
    expected = json.loads(answer_pool._encode_generate(parsed, outs))

    async def main() -> list[bytes]:
        enc = answer_pool.AnswerEncoder(1, min_numbers=0)
        try:
            answers = [await enc.generate(parsed, outs) for _ in range(5)]
            assert enc.workers == 0 and enc.helper_pids() == []
            return answers
        finally:
            enc.close()

    with caplog.at_level("WARNING", logger="asyncgrpo.server.http.answer_pool"):
        answers = asyncio.run(main())
    assert len(started) == answer_pool.MAX_HELPER_DEATHS  # none started after the third loss
    for a in answers:
        doc = json.loads(a)
        doc.pop("created"), expected.pop("created", None)
        assert doc == expected
    assert sum("building every answer in the server process" in r.message for r in caplog.records) == 1


def test_answer_helpers_exit_when_the_server_process_is_killed(tmp_path):
    """A SIGKILLed server leaves no helper process behind (they watch their parent)."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "server.py"
    script.write_text(
        "import asyncio\n"
        "from asyncgrpo.server.http.answer_pool import AnswerEncoder\n"
        "from asyncgrpo.server.http.protocol import ParsedRequest\n"
        "from asyncgrpo.server.engine.request import RequestOutput\n"
        "async def main():\n"
        "    enc = AnswerEncoder(2, min_numbers=0)\n"
        "    out = RequestOutput('r', [1], [5], [-0.5], 'length', None, [[(5, -0.5)]])\n"
        "    for _ in range(4):\n"
        "        await enc.generate(ParsedRequest('g', 'm', None, [1], [], 1), [out])\n"
        "    print(*enc.helper_pids(), flush=True)\n"
        "    await asyncio.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert pids

    deadline = time.monotonic() + 20
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(pid_alive, pids)), f"helpers {pids} outlived their server"


@pytest.mark.parametrize("library", ["orjson", "stdlib"])
def test_float32_log_probs_go_out_short_and_read_back_as_the_same_float32(library, monkeypatch):
    """The engine's float32 values: fewer bytes than 17 digits, and each reads back (as float32) bit for bit;
    with orjson its shortest float32 digits, without it C's 9 significant digits (FLT_DECIMAL_DIG)."""
    from asyncgrpo import json_codec

    if library == "orjson" and json_codec.orjson is None:
        pytest.skip("orjson is not installed")
    if library == "stdlib":
        monkeypatch.setattr(json_codec, "orjson", None)
    out, short = _float32_output(7, 60, 8), _float32_output(8, 5, 8)  # numpy path / short-answer loop path
    parsed = ParsedCompletion("c", "m", None, [1, 2, 3], [], 8, return_token_ids=True, return_tokens_as_token_ids=True)
    wire = encode_json(completion_response(parsed, [out], lambda ids: ""))
    body = json.loads(wire)
    (choice,) = body["choices"]
    (small,) = json.loads(encode_json(completion_response(parsed, [short], lambda ids: "")))["choices"]
    assert np.float32(small["logprobs"]["token_logprobs"]).tolist() == short.logprobs
    assert [{k: float(np.float32(v)) for k, v in d.items()} for d in small["logprobs"]["top_logprobs"]] == (
        _reference_completion_logprobs(short)["top_logprobs"])  # fmt: skip
    ref = _reference_completion_logprobs(out)
    lp = choice["logprobs"]
    assert lp["tokens"] == ref["tokens"] and lp["text_offset"] == ref["text_offset"]
    assert np.float32(lp["token_logprobs"]).tolist() == out.logprobs  # bit for bit at float32
    for got, want in zip(lp["top_logprobs"], ref["top_logprobs"]):
        assert list(got) == list(want) and np.float32(list(got.values())).tolist() == list(want.values())
    doubles = completion_response(parsed, [_output(random.Random(7), 60, 8)], lambda ids: "")  # not float32
    assert len(wire) < 0.85 * len(encode_json(doubles))
    if library == "orjson":  # shortest: 0.0 and -0.5 need no padding digits
        assert lp["token_logprobs"][:2] == [0.0, -0.5] and b'"token_logprobs":[0.0,-0.5,' in wire
    gen = json.loads(encode_json(generate_response(ParsedRequest("g", "m", None, [1], [], 8), [out])))
    content = gen["choices"][0]["logprobs"]["content"]
    assert np.float32([e["logprob"] for e in content]).tolist() == out.logprobs
    assert [e["rank"] for e in content] == [e["rank"] for e in _reference_generate_content(out)]


def test_helpers_started_when_the_server_serves_take_the_first_answer():
    """start_helpers (the server calls it once it listens): the helpers run before any answer, and the first
    answer goes to one of them instead of starting new ones; with no helpers asked for, none start."""
    from asyncgrpo.server.http.answer_pool import AnswerEncoder

    outs = [_output(random.Random(8), 64, 8)]
    parsed = ParsedRequest("g", "m", None, [1, 2, 3], [], 8)

    async def main() -> tuple[list[int], list[int], bool, list[int]]:
        enc, off = AnswerEncoder(2, min_numbers=0), AnswerEncoder(0)
        try:
            loop = asyncio.get_running_loop()
            enc.start_helpers(loop)
            off.start_helpers(loop)
            started = enc.helper_pids()
            alive = all(pid_alive(p) for p in started)
            await enc.generate(parsed, outs)
            return started, enc.helper_pids(), alive, off.helper_pids()
        finally:
            enc.close()

    started, after, alive, none = asyncio.run(main())
    assert len(started) == 2 and alive
    assert after == started
    assert none == []

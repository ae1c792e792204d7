"""Answers parsed by helper processes (``client/answer_parse.py``) against the inline parse of the same bytes:
the server's real answer writer makes the bytes; errors, a helper that dies, cancelled calls and closing."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from asyncgrpo.client.answer_parse import AnswerParsers, parse_choices
from asyncgrpo.errors import ServerError
from asyncgrpo.server.http.protocol import ParsedCompletion, completion_response, encode_json
from tests.helpers.answers import float32_output


def _answer(seed: int, tokens: int = 200, k: int = 8) -> bytes:
    parsed = ParsedCompletion("cmpl-1", "m", None, [1, 2, 3], [], k, return_token_ids=True,
                              return_tokens_as_token_ids=True, return_weight_versions=True)  # fmt: skip
    return encode_json(completion_response(parsed, [float32_output(seed, tokens, k)], lambda ids: ""))


def _same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert (x.token_ids, x.logprobs, x.finish_reason, x.weight_versions) == (
            y.token_ids, y.logprobs, y.finish_reason, y.weight_versions)  # fmt: skip
        assert np.array_equal(x.top_logprobs.ids, y.top_logprobs.ids)
        assert np.array_equal(x.top_logprobs.values, y.top_logprobs.values)


def test_helpers_parse_like_the_event_loop_and_small_answers_stay_inline():
    bodies = [_answer(s) for s in range(6)]

    async def main():
        parsers = AnswerParsers(2, min_bytes=len(bodies[0]) // 2)
        try:
            small = await parsers.parse(_answer(9, tokens=4), "completions", "r")
            assert parsers._start_task is None  # a small answer never starts a helper
            first = await parsers.parse(bodies[0], "completions", "r0")  # starts them; parsed inline meanwhile
            assert parsers._start_task is not None and await parsers.wait_ready()
            _same(first, parse_choices(bodies[0], "completions", "r0"))
            got = await asyncio.gather(*(parsers.parse(b, "completions", f"r{i}") for i, b in enumerate(bodies)))
            assert len(parsers._procs) == 2 and parsers.active
            return small, got
        finally:
            await parsers.close()

    small, got = asyncio.run(main())
    _same(small, parse_choices(_answer(9, tokens=4), "completions", "r"))
    for i, (b, res) in enumerate(zip(bodies, got, strict=True)):
        _same(res, parse_choices(b, "completions", f"r{i}"))
        assert res[0].request_id == "cmpl-1"


def test_a_bad_answer_raises_what_the_inline_parse_raises():
    bad = [
        b"{" + b"x" * 100,
        _answer(1).replace(b'{"token_id:', b'{"tok:', 1),
    ]  # bad JSON; a top-N key without its prefix

    async def main():
        parsers = AnswerParsers(1, min_bytes=0)
        try:
            assert await parsers.wait_ready()
            for body in bad:
                with pytest.raises(Exception) as inline:
                    parse_choices(body, "completions", None)
                with pytest.raises(type(inline.value)) as helped:
                    await parsers.parse(body, "completions", None)
                assert str(helped.value) == str(inline.value)
            assert parsers.active  # a bad answer is not a broken helper
        finally:
            await parsers.close()

    asyncio.run(main())
    with pytest.raises(ServerError, match="answer is not JSON"):
        parse_choices(bad[0], "completions", None)


def test_a_dead_helper_is_reported_once_and_answers_are_parsed_inline(caplog):
    body = _answer(2)

    async def main():
        parsers = AnswerParsers(1, min_bytes=0)
        try:
            assert await parsers.wait_ready()
            await parsers.parse(body, "completions", None)
            parsers._procs[0].kill()
            await parsers._procs[0].wait()
            with caplog.at_level(logging.WARNING, logger="asyncgrpo.client.answer_parse"):
                first = await parsers.parse(body, "completions", None)
                second = await parsers.parse(body, "completions", None)
            return first, second, parsers.active
        finally:
            await parsers.close()

    first, second, active = asyncio.run(main())
    assert not active
    _same(first, parse_choices(body, "completions", None))
    _same(second, first)
    assert len([r for r in caplog.records if "stopped" in r.getMessage()]) == 1


def test_cancelled_calls_retire_their_helper_and_waiters_fall_back_inline():
    body = _answer(3, tokens=400)

    async def main():
        parsers = AnswerParsers(1, min_bytes=0)
        try:
            assert await parsers.wait_ready()
            running = asyncio.create_task(parsers.parse(body, "completions", None))
            waiting = asyncio.create_task(parsers.parse(body, "completions", None))  # queued for the one helper
            await asyncio.sleep(0)
            running.cancel()
            with pytest.raises(asyncio.CancelledError):
                await running
            result = await asyncio.wait_for(waiting, 30)  # woken by the give-up, parsed inline
            return result, parsers.active
        finally:
            await parsers.close()

    result, active = asyncio.run(main())
    assert not active
    _same(result, parse_choices(body, "completions", None))


def test_close_ends_the_helpers():
    async def main():
        parsers = AnswerParsers(2, min_bytes=0)
        assert await parsers.wait_ready()
        await parsers.parse(_answer(4), "completions", None)
        procs = list(parsers._procs)
        await parsers.close(timeout_s=10)
        return [p.returncode for p in procs]

    assert asyncio.run(main()) == [0, 0]


def test_a_helper_that_stops_answering_is_retired_after_the_parse_timeout(caplog):
    """A helper that hangs (stopped here with SIGSTOP) costs one parse timeout, names itself, and the answer is
    parsed inline; with no helper left, later answers are parsed inline at once."""
    import os
    import signal

    body = _answer(5)

    async def main():
        parsers = AnswerParsers(1, min_bytes=0, parse_timeout_s=1.0)
        try:
            assert await parsers.wait_ready()
            os.kill(parsers._procs[0].pid, signal.SIGSTOP)
            with caplog.at_level(logging.WARNING, logger="asyncgrpo.client.answer_parse"):
                first = await asyncio.wait_for(parsers.parse(body, "completions", None), 20)
            second = await asyncio.wait_for(parsers.parse(body, "completions", None), 5)
            return first, second, parsers.active
        finally:
            await parsers.close()

    first, second, active = asyncio.run(main())
    assert not active
    _same(first, parse_choices(body, "completions", None))
    _same(second, first)
    assert any("gave no answer within 1 s" in r.getMessage() for r in caplog.records)

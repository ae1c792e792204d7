"""Build and encode the generation answers in helper processes, off the engine's GIL.

The HTTP handlers and the engine thread share one interpreter lock. A GRPO answer carries ~10
numbers per generated token (``logprobs=8``); writing them as JSON text is a few microseconds per
token of pure interpreter work, and every millisecond of it is a millisecond the engine thread
cannot run its step. With ``answer_workers > 0`` the handler only pickles the engine's outputs
(lists of numbers: a fraction of the formatting cost) and a spawned helper builds the bytes.

Small answers stay inline (a round trip to a helper costs more than it saves), and so do answers
that need the tokenizer for per-token strings (completions without ``return_tokens_as_token_ids``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from asyncgrpo.server.http_protocol import (
    ParsedCompletion,
    ParsedRequest,
    completion_response,
    encode_json,
    generate_response,
)
from asyncgrpo.server.packed_top import packed_output
from asyncgrpo.server.request import RequestOutput

logger = logging.getLogger(__name__)

MIN_OFFLOAD_NUMBERS = 2048  # answers with fewer log-prob numbers are built inline


class _Texts:
    """A picklable stand-in for the tokenizer's decode: the choices' texts, computed in the server process."""

    def __init__(self, texts: dict[tuple[int, ...], str]) -> None:
        self.texts = texts

    def __call__(self, ids: list[int]) -> str:
        return self.texts[tuple(ids)]


def _exit_with_parent() -> None:
    """Helper-process initializer: exit when the server process is gone (even SIGKILLed), never linger."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()  # returns when the parent's sentinel closes
        os._exit(0)

    threading.Thread(target=watch, name="watch-server", daemon=True).start()


def _encode_generate(parsed: ParsedRequest, outputs: list[RequestOutput]) -> bytes:
    return encode_json(generate_response(parsed, outputs))


def _encode_completion(parsed: ParsedCompletion, outputs: list[RequestOutput], texts: _Texts) -> bytes:
    return encode_json(completion_response(parsed, outputs, texts))


def packed_outputs(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """The outputs as they travel to a helper: top-N pairs packed into arrays (``packed_top.py``), which pickle
    and unpickle as bytes instead of one tuple, int and float per entry."""
    return list(map(packed_output, outputs))


def _numbers(parsed: ParsedRequest, outputs: list[RequestOutput]) -> int:
    if parsed.logprobs is None:
        return 0
    return sum(len(o.token_ids) for o in outputs) * (parsed.logprobs + 2)


class AnswerEncoder:
    """Encodes generation answers inline (``workers=0``) or in a pool of ``workers`` spawned processes."""

    def __init__(self, workers: int, min_numbers: int = MIN_OFFLOAD_NUMBERS) -> None:
        if workers < 0:
            raise ValueError(f"answer workers must be >= 0, got {workers}")
        self.workers = workers
        self.min_numbers = min_numbers
        self._pool: ProcessPoolExecutor | None = None

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, never fork: the server process holds CUDA state and engine threads
            self._pool = ProcessPoolExecutor(
                self.workers, mp_context=mp.get_context("spawn"), initializer=_exit_with_parent
            )
            logger.info("answer encoding in %d helper processes", self.workers)
        return self._pool

    async def generate(self, parsed: ParsedRequest, outputs: list[RequestOutput]) -> bytes:
        if not self.workers or _numbers(parsed, outputs) < self.min_numbers:
            return _encode_generate(parsed, outputs)
        light = dataclasses.replace(parsed, requests=[])  # the engine requests are not part of the answer
        return await self._submit(_encode_generate, light, packed_outputs(outputs))

    async def completion(
        self, parsed: ParsedCompletion, outputs: list[RequestOutput], decode: Callable[[list[int]], str]
    ) -> bytes:
        if not self.workers or not parsed.return_tokens_as_token_ids or _numbers(parsed, outputs) < self.min_numbers:
            return encode_json(completion_response(parsed, outputs, decode))
        texts = _Texts({tuple(o.token_ids): decode(list(o.token_ids)) for o in outputs})
        light = dataclasses.replace(parsed, requests=[])
        return await self._submit(_encode_completion, light, packed_outputs(outputs), texts)

    async def _submit(self, fn: Callable[..., bytes], *args: Any) -> bytes:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._get_pool(), fn, *args)
        except BrokenProcessPool as exc:  # a helper died (e.g. killed): answer inline, start a new pool next time
            logger.warning("answer helper process failed (%s); encoding this answer inline", exc)
            self._pool = None
            return fn(*args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

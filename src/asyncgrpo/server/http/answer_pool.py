"""Build and encode the generation answers in helper processes, off the engine's GIL.

The HTTP handlers and the engine thread share one interpreter lock. A GRPO answer carries ~10
numbers per generated token (``logprobs=8``); writing them as JSON text is a few microseconds per
token of pure interpreter work, and every millisecond of it is a millisecond the engine thread
cannot run its step. With ``answer_workers > 0`` the handler only pickles the engine's outputs
(lists of numbers: a fraction of the formatting cost) and a spawned helper builds the bytes.

The helpers are plain processes on a socket pair each, driven from the event loop itself: the
handler writes the job, and the loop reads the answer when the socket turns readable. A
``ProcessPoolExecutor`` adds two threads to the server process (one pickles the jobs, one reads
the results and wakes the loop through a pipe of its own); when 256 answers finish together, the
hand-offs between those threads, the pipe reader and the loop were a large share of the time the
server process took per answer, which is the time the last answer waits.

A helper that dies or fails a job costs no answer: the handler builds it inline. A helper that keeps a
job past ``HELPER_TIMEOUT_S`` is killed; after ``MAX_HELPER_DEATHS`` losses in a row the server builds
every answer itself.

Small answers stay inline (a round trip to a helper costs more than it saves), and so do answers
that need the tokenizer for per-token strings (completions without ``return_tokens_as_token_ids``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from asyncgrpo.server.engine.packed_top import packed_output
from asyncgrpo.server.engine.request import RequestOutput
from asyncgrpo.server.http.protocol import (
    ParsedCompletion,
    ParsedRequest,
    completion_response,
    encode_json,
    generate_response,
)

logger = logging.getLogger(__name__)

MIN_OFFLOAD_NUMBERS = 2048  # answers with fewer log-prob numbers are built inline
LOG_EVERY_S = 30.0  # a job a live helper keeps this long gets a line
HELPER_TIMEOUT_S = 120.0  # a helper that keeps a job this long is killed; its jobs are built inline
MAX_HELPER_DEATHS = 3  # helpers lost in a row (none answering between) before the server stops starting new ones
READ_CHUNK = 1 << 20  # bytes the loop takes from a helper's socket per read


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
    """The outputs as they travel to a helper: top-N pairs packed into arrays (``engine/packed_top.py``), which pickle
    and unpickle as bytes instead of one tuple, int and float per entry."""
    return list(map(packed_output, outputs))


def _numbers(parsed: ParsedRequest, outputs: list[RequestOutput]) -> int:
    if parsed.logprobs is None:
        return 0
    return sum(len(o.token_ids) for o in outputs) * (parsed.logprobs + 2)


class HelperFailed(RuntimeError):
    """A helper process died or failed a job; the caller builds that answer inline."""


_FRAME = struct.Struct("<QBQ")  # job id; 1 = an answer / 0 = an error message; length of what follows


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError("the server closed the helper's socket")
        got += k
    return bytes(buf)


def _helper_main(sock: socket.socket) -> None:
    """A helper process: a thread drains the socket into a queue (so the server's writes never wait on a build in
    progress), the main thread builds each job and writes its frame back."""
    _exit_with_parent()
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def drain() -> None:
        try:
            while True:
                job, _, n = _FRAME.unpack(_read_exact(sock, _FRAME.size))
                inbox.put((job, _read_exact(sock, n)))
        except (EOFError, OSError):
            inbox.put(None)

    threading.Thread(target=drain, name="answer-jobs", daemon=True).start()
    while (item := inbox.get()) is not None:
        job, msg = item
        try:
            fn, args = pickle.loads(msg)
            ok, body = 1, fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the server, which builds the answer inline
            ok, body = 0, f"{type(exc).__name__}: {exc}".encode()
        try:
            sock.sendall(_FRAME.pack(job, ok, len(body)) + body)
        except OSError:
            return


class _Helper:
    """One helper process and the server's end of its socket: jobs not yet written out, bytes not yet framed,
    jobs not yet answered. The server's end never blocks: the loop writes what the socket takes and reads what
    it has."""

    def __init__(self, ctx: Any) -> None:
        self.sock, child = socket.socketpair()
        self.proc = ctx.Process(target=_helper_main, args=(child,), name="asyncgrpo-answer", daemon=True)
        self.proc.start()
        child.close()
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        self.out = bytearray()  # frames the socket did not take yet (the loop writes them when it can)
        self.inbuf = bytearray()  # bytes read, not yet cut into frames
        self.rbuf = bytearray(READ_CHUNK)
        self.rview = memoryview(self.rbuf)
        self.jobs: dict[int, asyncio.Future] = {}


def _fail_jobs(helper: _Helper, why: str) -> None:
    """The helper's unanswered jobs fail with :class:`HelperFailed`: their handlers build those answers inline."""
    for fut in helper.jobs.values():
        if not fut.done() and not fut.get_loop().is_closed():
            fut.set_exception(HelperFailed(why))
    helper.jobs.clear()


class AnswerEncoder:
    """Encodes generation answers inline (``workers=0``) or in ``workers`` spawned helper processes."""

    def __init__(self, workers: int, min_numbers: int = MIN_OFFLOAD_NUMBERS) -> None:
        if workers < 0:
            raise ValueError(f"answer workers must be >= 0, got {workers}")
        self.workers = workers
        self.min_numbers = min_numbers
        self._helpers: list[_Helper] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._deaths = 0  # helpers lost since one last answered

    def helper_pids(self) -> list[int]:
        return [h.proc.pid for h in self._helpers]

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
        loop = asyncio.get_running_loop()
        try:
            helper = self._pick(loop)
            try:
                msg = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:
                raise HelperFailed(f"the job does not pickle ({exc})") from exc
            job = next(self._ids)
            self._write(helper, _FRAME.pack(job, 1, len(msg)) + msg)  # a failed write drops the helper and raises
            fut = loop.create_future()  # registered after the write: no job of a dropped helper is left unread
            helper.jobs[job] = fut
            return await self._answer(loop, fut, helper)
        except HelperFailed as exc:  # a helper died or failed: answer inline, start a new helper next time
            logger.info("building this answer in the server process: %s", exc)
            return fn(*args)

    async def _answer(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future, helper: _Helper) -> bytes:
        """The job's bytes. A build takes milliseconds: a line every ``LOG_EVERY_S`` while a live helper keeps the
        job, and after ``HELPER_TIMEOUT_S`` the helper is killed and its jobs are built inline."""
        t0 = time.monotonic()

        def tick() -> None:
            nonlocal handle
            waited = time.monotonic() - t0
            if waited >= HELPER_TIMEOUT_S:
                helper.proc.kill()
                self._drop(helper, f"pid {helper.proc.pid} kept a job {waited:.0f} s; killed it", raise_=False)
                return
            logger.info("still waiting for answer helper pid %d (%.0f s so far)", helper.proc.pid, waited)
            handle = loop.call_later(min(LOG_EVERY_S, HELPER_TIMEOUT_S - waited), tick)

        handle = loop.call_later(min(LOG_EVERY_S, HELPER_TIMEOUT_S), tick)
        try:
            return await fut
        finally:
            handle.cancel()

    def start_helpers(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the helpers now, bound to ``loop`` (the server does once it serves: a helper's interpreter and
        imports take a few hundred ms, which otherwise sat inside the first large answer of a run)."""
        if not self.workers:
            return
        if self._loop is not loop:
            self.close()
            self._loop = loop
        if len(self._helpers) < self.workers:
            ctx = mp.get_context("spawn")  # spawn, never fork: the server process holds CUDA state and threads
            while len(self._helpers) < self.workers:
                helper = _Helper(ctx)
                loop.add_reader(helper.fd, self._on_readable, helper)
                self._helpers.append(helper)
            logger.info("answer encoding in %d helper processes", self.workers)

    def _pick(self, loop: asyncio.AbstractEventLoop) -> _Helper:
        """The helper with the fewest jobs in hand; helpers not started yet (or lost) start now, bound to this loop."""
        if not self.workers:
            raise HelperFailed("the answer helpers are off")
        self.start_helpers(loop)
        return min(self._helpers, key=lambda h: len(h.jobs))

    def _write(self, helper: _Helper, frame: bytes) -> None:
        if not helper.out:
            try:
                sent = helper.sock.send(frame)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._drop(helper, f"writing to pid {helper.proc.pid} failed ({exc})")
            if sent == len(frame):
                return
            frame = frame[sent:]
            self._loop.add_writer(helper.fd, self._on_writable, helper)  # type: ignore[union-attr]
        helper.out += frame

    def _on_writable(self, helper: _Helper) -> None:
        try:
            sent = helper.sock.send(helper.out)
        except BlockingIOError:
            return
        except OSError as exc:
            self._drop(helper, f"writing to pid {helper.proc.pid} failed ({exc})", raise_=False)
            return
        del helper.out[:sent]
        if not helper.out:
            self._loop.remove_writer(helper.fd)  # type: ignore[union-attr]

    def _on_readable(self, helper: _Helper) -> None:
        try:
            got = helper.sock.recv_into(helper.rbuf)  # into a buffer kept for it: no megabyte allocated per read
        except BlockingIOError:
            return
        except OSError as exc:
            got, why = 0, str(exc)
        else:
            why = "its socket closed"
        if not got:
            self._drop(helper, f"pid {helper.proc.pid} exited ({why})", raise_=False)
            return
        buf = helper.inbuf
        buf += helper.rview[:got]
        at = 0
        while len(buf) - at >= _FRAME.size:
            job, ok, n = _FRAME.unpack_from(buf, at)
            if len(buf) - at - _FRAME.size < n:
                break
            body = bytes(buf[at + _FRAME.size : at + _FRAME.size + n])
            at += _FRAME.size + n
            fut = helper.jobs.pop(job, None)
            if fut is None or fut.done():
                continue
            if ok:
                self._deaths = 0
                fut.set_result(body)
            else:
                why = f"helper pid {helper.proc.pid} failed a job: {body.decode(errors='replace')}"
                logger.warning("%s; building it here", why)
                fut.set_exception(HelperFailed(why))
        del buf[:at]

    def _drop(self, helper: _Helper, why: str, raise_: bool = True) -> None:
        """Forget a failed helper: its jobs fail (their callers build inline) and a new one starts on next use."""
        if helper in self._helpers:
            self._helpers.remove(helper)
            self._close_helper(helper)
            logger.warning("lost an answer helper: %s; its %d unanswered jobs are built here", why, len(helper.jobs))
            self._deaths += 1
            if self._deaths >= MAX_HELPER_DEATHS and self.workers:
                logger.error("%d answer helpers failed in a row (last: %s); building every answer in the server "
                             "process from now on", self._deaths, why)  # fmt: skip
                self.workers = 0
                self.close()
        _fail_jobs(helper, why)
        if raise_:
            raise HelperFailed(why)

    def _close_helper(self, helper: _Helper) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(helper.fd)
            self._loop.remove_writer(helper.fd)
        helper.sock.close()  # the helper's reader sees EOF and it exits

    def close(self) -> None:
        helpers, self._helpers = self._helpers, []
        for helper in helpers:
            self._close_helper(helper)
            _fail_jobs(helper, "the answer helpers were closed")
        self._loop = None

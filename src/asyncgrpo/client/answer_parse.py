"""Generation answers parsed off the event loop: a few helper processes decode the large ones.

A completions answer with top-8 log-probs is ~280 bytes of JSON per generated token, and decoding it costs
the client ~3.5 us per token (JSON decode, then the top-N into arrays), all on the one event loop that also
sends requests, scores groups and feeds the trainer. When many answers end on the same step (a batch of equal
lengths, or several servers feeding one worker) the loop parses them one after another and everything else
waits. Answers of at least :data:`PARSE_OFF_LOOP_BYTES` therefore go to helper processes (``python -m
asyncgrpo.client.answer_parse``, so they import only the client, never the user's training script) over
pipes: the loop pays a copy of the bytes and the unpickling of compact results. Smaller answers, and every
answer when no helper runs, are parsed inline. A helper that dies is reported once and the client parses
inline from then on; a parse error is re-raised by parsing the same bytes inline, so the caller sees exactly
the error the inline path gives.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import struct
import sys
import time
from typing import Any

from asyncgrpo import json_codec
from asyncgrpo.client.results import GenerationResult, parse_completion_choice, parse_generate_choice
from asyncgrpo.errors import ServerError

logger = logging.getLogger(__name__)

PARSE_OFF_LOOP_BYTES = 32 << 10  # ~110 tokens at top-8; below this a process hop costs more than it saves
_HEADER = struct.Struct("<I")
_PARSERS = {"completions": parse_completion_choice, "generate": parse_generate_choice}
_ENDPOINTS = {"completions": "POST /v1/completions", "generate": "POST /inference/v1/generate"}


def default_parse_processes() -> int:
    """Helpers for a rollout worker: a quarter of the CPUs this process may run on, at most 4 (none on 2)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cpus // 4)


def parse_choices(body: bytes, kind: str, request_id: str | None) -> list[GenerationResult]:
    """Decode one generation answer: its choices in index order (vLLM may write them out of order)."""
    try:
        data = json_codec.loads(body)
    except ValueError as exc:
        raise ServerError(_ENDPOINTS[kind], 200, f"answer is not JSON: {body[:200]!r}") from exc
    choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
    rid = data.get("request_id", data.get("id", request_id))
    parse = _PARSERS[kind]
    return [parse(c, rid) for c in choices]


class AnswerParsers:
    """Helper processes that parse answers for the clients of one event loop (shared by a ServerPool's clients).

    Args:
        processes: how many helpers; 0 parses everything inline; None: :func:`default_parse_processes`.
        min_bytes: answers smaller than this are parsed inline.
        start_timeout_s: how long starting the helpers (all of them) may take before the client gives up on them.
        parse_timeout_s: how long one answer may take in a helper (milliseconds normally); past it the helper is
            retired with a warning and the answer is parsed inline.
    """

    def __init__(self, processes: int | None, min_bytes: int = PARSE_OFF_LOOP_BYTES, start_timeout_s: float = 30.0,
                 parse_timeout_s: float = 30.0) -> None:  # fmt: skip
        self.processes = default_parse_processes() if processes is None else max(0, int(processes))
        self.min_bytes = min_bytes
        self.start_timeout_s = start_timeout_s
        self.parse_timeout_s = parse_timeout_s
        self._free: asyncio.Queue = asyncio.Queue()  # helpers that are up and idle (None: given up, parse inline)
        self._procs: list[asyncio.subprocess.Process] = []
        self._ready = 0  # helpers that said they are up
        self._broken = self.processes == 0
        self._start_task: asyncio.Task | None = None
        self._retired: set[int] = set()  # helpers dropped because a cancelled call left their pipe mid-message

    @property
    def active(self) -> bool:
        return not self._broken

    async def parse(self, body: bytes, kind: str, request_id: str | None) -> list[GenerationResult]:
        """Parse ``body`` in a helper when it is large and a helper is up; inline otherwise (helpers still booting
        included: the first large answer starts them in the background rather than waiting for them)."""
        if self._broken or len(body) < self.min_bytes:
            return parse_choices(body, kind, request_id)
        self.start()
        if self._ready == 0:
            return parse_choices(body, kind, request_id)
        proc = await self._free.get()
        if proc is None:  # helpers were given up while this call waited for one
            self._free.put_nowait(None)
            return parse_choices(body, kind, request_id)
        try:
            reply = await asyncio.wait_for(self._round_trip(proc, pickle.dumps((kind, request_id, body), protocol=5)),
                                           self.parse_timeout_s)  # fmt: skip
        except TimeoutError:  # its pipe may hold half a message: that helper serves no one else
            logger.warning("answer-parsing helper pid %d gave no answer within %.0f s; retiring it and parsing on the "
                           "event loop", proc.pid, self.parse_timeout_s)  # fmt: skip
            self._retire(proc)
            return parse_choices(body, kind, request_id)
        except (OSError, EOFError, asyncio.IncompleteReadError, ConnectionError) as exc:
            self._give_up(f"an answer-parsing helper (pid {proc.pid}) stopped: {type(exc).__name__}: {exc}")
            return parse_choices(body, kind, request_id)
        except asyncio.CancelledError:  # its pipe may hold half a message: that helper serves no one else
            self._retire(proc)
            raise
        self._free.put_nowait(proc)
        ok, value = reply
        if not ok:  # the inline parse raises the same error, with its own type and message
            return parse_choices(body, kind, request_id)
        return value

    async def _round_trip(self, proc: asyncio.subprocess.Process, payload: bytes) -> Any:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(_HEADER.pack(len(payload)) + payload)
        await proc.stdin.drain()
        (size,) = _HEADER.unpack(await proc.stdout.readexactly(_HEADER.size))
        return pickle.loads(await proc.stdout.readexactly(size))

    def start(self) -> None:
        """Start the helpers in the background (idempotent); answers are parsed inline until one is up."""
        if self._start_task is None and not self._broken:
            self._start_task = asyncio.ensure_future(self._start())

    async def wait_ready(self) -> bool:
        """Start the helpers and wait until every one is up (or given up); True when they run."""
        self.start()
        if self._start_task is not None:
            await asyncio.shield(self._start_task)
        return not self._broken

    async def _start(self) -> None:
        try:
            for _ in range(self.processes):
                self._procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "asyncgrpo.client.answer_parse",
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                ))  # fmt: skip
            deadline = time.monotonic() + self.start_timeout_s  # for all of them together
            for proc in list(self._procs):
                assert proc.stdout is not None
                left = max(deadline - time.monotonic(), 0.0)
                await asyncio.wait_for(proc.stdout.readexactly(1), left)  # its "up" byte
                if self._broken:
                    return
                self._ready += 1
                self._free.put_nowait(proc)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            self._give_up(f"answer-parsing helpers did not start within {self.start_timeout_s:.0f} s: "
                          f"{type(exc).__name__}: {exc}")  # fmt: skip

    def _retire(self, proc: asyncio.subprocess.Process) -> None:
        self._retired.add(proc.pid)
        if proc.returncode is None:
            proc.kill()
        if len(self._retired) >= len(self._procs):
            self._give_up("every answer-parsing helper was retired by cancelled calls")

    def _give_up(self, why: str) -> None:
        if not self._broken:
            logger.warning("%s; answers are parsed on the event loop from now on", why)
        self._broken = True
        self._kill()
        self._free.put_nowait(None)  # wakes calls waiting for a helper: they parse inline

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.returncode is None:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop the helpers (closing their stdin ends them; a helper still running after ``timeout_s`` is killed)."""
        procs, self._procs = self._procs, []
        self._broken = True
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
        for proc in procs:
            if proc.stdin is not None and not proc.stdin.is_closing():
                proc.stdin.close()
        for proc in procs:
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                logger.warning("answer-parsing helper pid %d did not exit within %.0f s; killing it", proc.pid,
                               timeout_s)  # fmt: skip
                proc.kill()
                await proc.wait()


def _serve(stdin: Any, stdout: Any) -> None:
    """A helper's loop: length-prefixed pickles ``(kind, request_id, body)`` in, ``(ok, results)`` out."""
    while True:
        head = stdin.read(_HEADER.size)
        if len(head) < _HEADER.size:
            return  # the client closed the pipe: done
        (size,) = _HEADER.unpack(head)
        kind, request_id, body = pickle.loads(stdin.read(size))
        try:
            reply = (True, parse_choices(body, kind, request_id))
        except Exception:  # noqa: BLE001 - the client re-parses inline to raise the precise error
            reply = (False, None)
        out = pickle.dumps(reply, protocol=5)
        stdout.write(_HEADER.pack(len(out)) + out)
        stdout.flush()


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the client ends us
    os.nice(5)  # parsing must never take a core from the engine or the worker's event loop
    sys.stdout.buffer.write(b"R")  # up: imports done
    sys.stdout.buffer.flush()
    _serve(sys.stdin.buffer, sys.stdout.buffer)

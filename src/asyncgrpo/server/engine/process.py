"""The engine in a process of its own, so the HTTP layer's Python never holds the engine's interpreter lock.

Why: in one process, the event loop (parsing requests, building answers with thousands of log-probs, aiohttp
itself) and the engine thread share one GIL. Under a GRPO load (hundreds of requests in flight, an answer
finishing every few milliseconds) the engine on an H200 sat idle about half of the time waiting for the lock,
and its eager prefill steps took several times their GPU time. vLLM splits its API server and its engine core
into two processes for the same reason.

:class:`RemoteEngine` is the API process's stand-in for :class:`~asyncgrpo.server.engine.engine.Engine`: the same
methods the HTTP layer uses, forwarded over one duplex pipe of pickled tuples. The weight receiver must sit
beside the weights, so it lives in the engine process too, behind :class:`RemoteReceiver`.

    API -> engine: ("submit", Request) | ("abort", id) | ("call", call_id, target, name, args, kwargs) | ("stop",)
    engine -> API: ("ready", info) | ("failed", error) | ("finish", RequestOutput) | ("reply", call_id, ok, value)

A finished output crosses without its ``prompt_token_ids`` (the API process keeps the request) and with its top-N
as one byte block (``packed_top.PackedTop``): a GRPO answer of 256 tokens at top-8 pickles to ~22 KB, not ~40 KB.

If the engine process dies, every request in flight finishes with an error naming its exit code, every call
raises, and ``is_alive`` turns False (``/health`` answers 503).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import multiprocessing as mp
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncgrpo.server.engine.awaiting import awaited
from asyncgrpo.server.engine.request import Request, RequestOutput, validate_request
from asyncgrpo.server.http.protocol import ApiError

logger = logging.getLogger(__name__)

LOG_EVERY_S = 30.0  # a wait longer than this prints what it waits for
# The engine thread gives up the GIL while it waits for the GPU and needs it back the moment a step ends; another
# thread running Python gets it only after this interval (CPython's default is 5 ms, most of a decode step). Both
# processes use it: in the API process the HTTP handlers share the lock with the pipe reader, in the engine process
# the engine thread shares it with the pipe threads, whose requests and finished answers waited up to 5 ms per
# hand-over at the default. A short interval bounds those waits; the extra switches cost microseconds.
GIL_SWITCH_INTERVAL_S = 0.0005
_BUILTIN_ERRORS = {e.__name__: e for e in (ValueError, TimeoutError, KeyError, RuntimeError, FileNotFoundError)}


# ---------------------------------------------------------------------- errors across the pipe
def _portable(exc: BaseException) -> tuple:
    if isinstance(exc, ApiError):
        return ("api", exc.status, exc.message, exc.param, exc.type)
    return ("exc", type(exc).__name__, str(exc))


def _rebuild(err: tuple) -> BaseException:
    if err[0] == "api":
        return ApiError(err[1], err[2], param=err[3], type_=err[4])
    cls = _BUILTIN_ERRORS.get(err[1])
    return cls(err[2]) if cls is not None else RuntimeError(f"{err[1]}: {err[2]}")


def _error_output(request: Request, message: str) -> RequestOutput:
    return RequestOutput(request.request_id, list(request.prompt_token_ids), [], [], "abort", error=message)


# ---------------------------------------------------------------------- the engine process
def _engine_main(conn: Any, engine_kwargs: dict[str, Any], receiver_args: tuple, log_level: int) -> None:
    """Entry point of the engine process: build the engine, then serve the pipe until told to stop."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    from asyncgrpo.server.engine.engine import Engine
    from asyncgrpo.server.engine.weight_receiver import WeightReceiver

    try:
        engine = Engine(**engine_kwargs)
    except BaseException as exc:  # noqa: BLE001 - the API process reports it (with its type) and exits
        conn.send(("failed", _portable(exc)))
        return
    targets = {"engine": engine, "receiver": WeightReceiver(engine, *receiver_args)}
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def send_all() -> None:  # the only writer of the pipe: the engine thread never blocks on a full pipe
        while (msg := outbox.get()) is not None:
            if msg[0] == "finish":  # its top-N is packed already (packed_top.engine_top, at the finish)
                msg[1].prompt_token_ids = None  # type: ignore[assignment]  # the API process has it (its request)
            try:
                conn.send(msg)
            except (OSError, ValueError):
                return

    sender = threading.Thread(target=send_all, name="engine-pipe-send", daemon=True)
    sender.start()
    outbox.put(("ready", _static_info(engine)))
    engine.start()

    def on_finish(out: RequestOutput) -> None:
        outbox.put(("finish", out))

    def run_call(call_id: int, target: str, name: str, args: tuple, kwargs: dict) -> None:
        try:
            attr = getattr(targets[target], name)
            outbox.put(("reply", call_id, True, attr(*args, **kwargs) if callable(attr) else attr))
        except BaseException as exc:  # noqa: BLE001 - raised again in the API process
            outbox.put(("reply", call_id, False, _portable(exc)))

    calls = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="engine-call")
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):  # the API process is gone: stop with it
                break
            kind = msg[0]
            if kind == "submit":
                try:
                    engine.submit(msg[1], on_finish)
                except ValueError as exc:  # raced with an adapter unload; the API process checked the rest
                    outbox.put(("finish", _error_output(msg[1], str(exc))))
            elif kind == "abort":
                engine.abort(msg[1])
            elif kind == "call":
                calls.submit(run_call, *msg[1:])
            elif kind == "stop":
                break
    finally:
        calls.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()
        outbox.put(None)
        sender.join(timeout=10)


def _static_info(engine: Any) -> dict[str, Any]:
    names = ("max_model_len", "vocab_size", "block_size", "num_blocks", "kv_cache_tokens", "max_num_seqs",
             "eos_token_ids", "general_path", "decode_backend", "gpu_uuid")  # fmt: skip
    info = {n: getattr(engine, n) for n in names}
    info["device"], info["dtype"] = str(engine.device), str(engine.dtype).removeprefix("torch.")
    return info


# ---------------------------------------------------------------------- the API process's stand-in
class RemoteEngine:
    """Starts the engine process and forwards the :class:`Engine` methods the HTTP layer uses.

    Args:
        engine_kwargs: keyword arguments of :class:`~asyncgrpo.server.engine.engine.Engine` (the model as a path).
        receiver_args: ``(backend, timeout_s)`` of the weight receiver built beside the engine.
        start_timeout_s: bound on loading the model and capturing the graphs.
    """

    def __init__(self, engine_kwargs: dict[str, Any], receiver_args: tuple, start_timeout_s: float = 1800.0):
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_engine_main, name="asyncgrpo-engine", daemon=True,
                                 args=(child, engine_kwargs, receiver_args, logging.getLogger().level))  # fmt: skip
        self._proc.start()
        child.close()
        self._send_lock = threading.Lock()
        self._callbacks: dict[str, Callable[[RequestOutput], None]] = {}
        self._requests: dict[str, Request] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._stopping = False
        self._lora_names: list[str] = []
        info = self._wait_ready(start_timeout_s, str(engine_kwargs.get("model")))
        for name, value in info.items():
            setattr(self, name, value)
        self.device = torch.device(info["device"])
        self.dtype = getattr(torch, info["dtype"])
        self.pid = self._proc.pid
        self.receiver = RemoteReceiver(self)
        self._reader = threading.Thread(target=self._read, name="engine-pipe-read", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float, model: str) -> dict[str, Any]:
        t0 = time.monotonic()
        while True:
            waited = time.monotonic() - t0
            if self._conn.poll(min(LOG_EVERY_S, max(timeout_s - waited, 0.0))):
                try:
                    kind, payload = self._conn.recv()
                except EOFError:
                    kind, payload = "failed", ("exc", "RuntimeError", "the engine process closed its pipe")
                if kind == "ready":
                    return payload
                self._proc.join(timeout=30)
                raise _rebuild(payload)
            waited = time.monotonic() - t0
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} while loading {model}")
            if waited >= timeout_s:
                self._proc.kill()
                raise TimeoutError(f"the engine process did not load {model} within {timeout_s:.0f} s")
            logger.info("waiting for the engine process to load %s (%.0f s so far)", model, waited)

    # ------------------------------------------------------------------ pipe
    def _send(self, msg: tuple) -> None:
        if self._dead is not None:
            raise RuntimeError(self._dead)
        with self._send_lock:
            self._conn.send(msg)

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            if msg[0] == "finish":
                out = msg[1]
                with self._lock:
                    cb = self._callbacks.pop(out.request_id, None)
                    req = self._requests.pop(out.request_id, None)
                if out.prompt_token_ids is None:  # not sent back: it is the request's
                    out.prompt_token_ids = req.prompt_token_ids if req is not None else []
                if cb is not None:
                    cb(out)
            elif msg[0] == "reply":
                with self._lock:
                    fut = self._calls.pop(msg[1], None)
                if fut is None:
                    continue
                if msg[2]:
                    fut.set_result(msg[3])
                else:
                    fut.set_exception(_rebuild(msg[3]))
        self._proc.join(timeout=5)
        self._fail_all(f"the engine process exited (code {self._proc.exitcode}); restart the server")

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self._dead = message
            pending = [(self._callbacks[i], self._requests[i]) for i in list(self._callbacks)]
            self._callbacks.clear()
            self._requests.clear()
            calls = list(self._calls.values())
            self._calls.clear()
        if self._stopping and not pending:
            return
        logger.error("%s; failing %d requests and %d calls in flight", message, len(pending), len(calls))
        for cb, req in pending:
            cb(_error_output(req, message))
        for fut in calls:
            fut.set_exception(RuntimeError(message))

    def call_future(self, target: str, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Start ``target.name(*args, **kwargs)`` in the engine process; the future holds its answer (an event
        loop awaits it without parking a thread on it)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead is not None:
                raise RuntimeError(self._dead)
            call_id = next(self._ids)
            self._calls[call_id] = fut
        self._send(("call", call_id, target, name, args, kwargs))
        return fut

    def call(self, target: str, name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``target.name(*args, **kwargs)`` in the engine process (or read the attribute) and return it."""
        fut = self.call_future(target, name, *args, **kwargs)
        t0 = time.monotonic()
        while True:
            left = None if timeout is None else timeout - (time.monotonic() - t0)
            try:
                return fut.result(timeout=LOG_EVERY_S if left is None else min(LOG_EVERY_S, max(left, 0.0)))
            except concurrent.futures.TimeoutError:
                if left is not None and left <= LOG_EVERY_S:
                    raise TimeoutError(f"the engine process did not answer {target}.{name} within {timeout} s")
                logger.info("waiting for the engine process: %s.%s (%.0f s)", target, name, time.monotonic() - t0)

    # ------------------------------------------------------------------ Engine's interface
    def start(self) -> None:
        """The engine process starts its engine itself; kept for :class:`Engine` compatibility."""

    def shutdown(self) -> None:
        self._stopping = True
        try:
            self._send(("stop",))
        except (RuntimeError, OSError):
            pass
        if not self._wait_exit(LOG_EVERY_S):  # it finishes its step and frees the GPU first; say what we wait for
            logger.info("waiting for the engine process (pid %d) to stop", self._proc.pid)
            if not self._wait_exit(LOG_EVERY_S):
                logger.warning("the engine process did not stop within %.0f s; killing it", 2 * LOG_EVERY_S)
                self._proc.kill()
                self._proc.join(timeout=10)

    def _wait_exit(self, seconds: float) -> bool:
        """Whether the engine process exited within ``seconds``. ``join`` alone can return early: the process's
        sentinel closes with its file descriptors, before the kernel has finished tearing it down (a CUDA
        context's teardown takes a while), so it is polled until the process is really gone."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            self._proc.join(timeout=max(left, 0.0))
            if not self._proc.is_alive():
                return True
            if left <= 0:
                return False
            time.sleep(min(0.05, left))

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    def submit(self, request: Request, on_finish: Callable[[RequestOutput], None]) -> None:
        validate_request(request, self.max_model_len, self.vocab_size, self._lora_names)
        with self._lock:
            if self._dead is not None:
                raise RuntimeError(self._dead)
            if request.request_id in self._callbacks:
                raise ValueError(f"request_id {request.request_id!r} is already in flight; ids must be unique")
            self._callbacks[request.request_id] = on_finish
            self._requests[request.request_id] = request
        self._send(("submit", request))

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._send(("abort", request_id))

    def pause(self, mode: str, timeout: float | None = None, *, clear_cache: bool = True) -> None:
        self.call("engine", "pause", mode, timeout, clear_cache=clear_cache)

    def resume(self) -> None:
        self.call("engine", "resume")

    def pause_future(self, mode: str, *, clear_cache: bool = True) -> concurrent.futures.Future:
        return self.call_future("engine", "pause", mode, None, clear_cache=clear_cache)

    def resume_future(self) -> concurrent.futures.Future:
        return self.call_future("engine", "resume")

    def reset_prefix_cache_future(self) -> concurrent.futures.Future:
        return self.call_future("engine", "reset_prefix_cache", None)

    @property
    def is_paused(self) -> bool:
        return self.call("engine", "is_paused", timeout=60)

    @property
    def weight_version(self) -> str:
        return self.call("engine", "weight_version", timeout=60)

    def stats(self) -> Any:
        return self.call("engine", "stats", timeout=60)

    def step_timings(self) -> dict[str, dict[str, float]]:
        return self.call("engine", "step_timings", timeout=60)

    def reset_prefix_cache(self, timeout: float | None = 60.0) -> bool:
        return self.call("engine", "reset_prefix_cache", timeout)

    def load_lora(self, name: str, path: str) -> None:
        self.call("engine", "load_lora", name, path)
        self._lora_names = self.call("engine", "lora_names", timeout=60)

    def unload_lora(self, name: str) -> None:
        self.call("engine", "unload_lora", name)
        self._lora_names = self.call("engine", "lora_names", timeout=60)

    @property
    def lora_names(self) -> list[str]:
        return list(self._lora_names)


class RemoteReceiver:
    """The weight receiver's protocol steps, run beside the weights in the engine process."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine

    def init(self, info: Any) -> None:
        self.engine.call("receiver", "init", info)

    def start(self) -> None:
        self.engine.call("receiver", "start", timeout=60)

    def update(self, info: Any) -> None:
        self.engine.call("receiver", "update", info)

    def finish(self, version: Any) -> str:
        return self.engine.call("receiver", "finish", version, timeout=300)

    # The event-loop forms (see WeightReceiver): the loop awaits the pipe's answer instead of blocking on it.
    async def start_async(self) -> None:
        await awaited(self.engine.call_future("receiver", "start"), "the engine process to start the update", 60)

    async def update_async(self, info: Any) -> None:
        await awaited(self.engine.call_future("receiver", "update", info), "the weight update in the engine process")

    async def finish_async(self, version: Any) -> str:
        fut = self.engine.call_future("receiver", "finish", version)
        return await awaited(fut, "the engine process to finish the update", 300)

    def set_profile(self, enabled: bool) -> bool:
        return self.engine.call("receiver", "set_profile", enabled, timeout=60)

    def last_profile(self) -> dict[str, Any] | None:
        return self.engine.call("receiver", "last_profile", timeout=300)

    def shutdown(self) -> None:
        self.engine.call("receiver", "shutdown", timeout=300)

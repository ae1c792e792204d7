"""The engine in a process of its own, so the HTTP layer's Python never holds the engine's interpreter lock.

Why: in one process, the event loop (parsing requests, building answers with thousands of log-probs, aiohttp
itself) and the engine thread share one GIL. Under a GRPO load (hundreds of requests in flight, an answer
finishing every few milliseconds) the engine on an H200 sat idle about half of the time waiting for the lock,
and its eager prefill steps took several times their GPU time. vLLM splits its API server and its engine core
into two processes for the same reason.

:class:`RemoteEngine` is the API process's stand-in for :class:`~asyncgrpo.server.engine.engine.Engine`: the same
members (:class:`~asyncgrpo.server.engine.api.EngineAPI`), forwarded over one duplex pipe of pickled records
(``commands.py``). The weight receiver must sit beside the weights, so it lives in the engine process too,
behind ``RemoteReceiver`` (``remote_receiver.py``: a ``ReceiverAPI`` like the receiver itself).

    API -> engine: Submit(request) | Abort(request_id) | RemoteCall(call_id, target, name, args, kwargs) | Stop()
    engine -> API: Ready(info) | Failed(error) | Finished(output) | Reply(call_id, value, error)

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
from typing import TYPE_CHECKING, Any

from asyncgrpo.server import bytecode, lean_imports
from asyncgrpo.server.engine.commands import (
    Abort,
    ErrorInfo,
    Failed,
    Finished,
    FromEngine,
    Ready,
    RemoteCall,
    Reply,
    Stop,
    Submit,
    ToEngine,
)
from asyncgrpo.server.engine.remote_receiver import RemoteReceiver
from asyncgrpo.server.engine.request import EngineStats, PauseMode, Request, RequestOutput, validate_request
from asyncgrpo.server.engine.settings import EngineSettings, ReceiverSettings
from asyncgrpo.server.errors import ApiError
from asyncgrpo.server.start_clock import StartClock

if TYPE_CHECKING:  # torch loads in the engine process and at wait_ready: the API process starts this one first
    import torch

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
def _portable(exc: BaseException) -> ErrorInfo:
    if isinstance(exc, ApiError):
        return ErrorInfo("ApiError", exc.message, status=exc.status, param=exc.param, api_type=exc.type)
    return ErrorInfo(type(exc).__name__, str(exc))


def _rebuild(err: ErrorInfo) -> BaseException:
    if err.status is not None:
        return ApiError(err.status, err.message, param=err.param, type_=err.api_type)
    cls = _BUILTIN_ERRORS.get(err.type_name)
    return cls(err.message) if cls is not None else RuntimeError(f"{err.type_name}: {err.message}")


def _error_output(request: Request, message: str) -> RequestOutput:
    return RequestOutput(request.request_id, list(request.prompt_token_ids), [], [], "abort", error=message)


# ---------------------------------------------------------------------- the engine process
def _engine_main(conn: Any, model: str, settings: EngineSettings, receiver: ReceiverSettings, log_level: int) -> None:
    """Entry point of the engine process: build the engine, then serve the pipe until told to stop."""
    clock = StartClock(role="engine")  # from this process's start: its interpreter and imports count too
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine]: %(message)s")
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    bytecode.keep_bytecode()  # the API process chose the folder (server/bytecode.py); this one writes there too
    lean_imports.enable()  # transformers without scikit-learn here (server/lean_imports.py)
    clock.part("interpreter")  # the interpreter's start and the imports of the pickled entry point (this module)
    from asyncgrpo.server.engine.engine import Engine

    clock.part("imports")  # torch's most of all
    clock.mark("process")
    try:
        engine = Engine(model, settings, clock=clock)
    except BaseException as exc:  # noqa: BLE001 - the API process reports it (with its type) and exits
        conn.send(Failed(_portable(exc)))
        return
    clock.ready()
    targets = {"engine": engine, "receiver": engine.weight_receiver(receiver)}
    outbox: queue.SimpleQueue[FromEngine | None] = queue.SimpleQueue()

    def send_all() -> None:  # the only writer of the pipe: the engine thread never blocks on a full pipe
        while (msg := outbox.get()) is not None:
            if isinstance(msg, Finished):  # its top-N is packed already (packed_top.engine_top, at the finish)
                msg.output.prompt_token_ids = None  # type: ignore[assignment]  # the API process has it (its request)
            try:
                conn.send(msg)
            except (OSError, ValueError):
                return

    sender = threading.Thread(target=send_all, name="engine-pipe-send", daemon=True)
    sender.start()
    outbox.put(Ready(_static_info(engine)))
    engine.start()

    def on_finish(out: RequestOutput) -> None:
        outbox.put(Finished(out))

    def run_call(call: RemoteCall) -> None:
        try:
            attr = getattr(targets[call.target], call.name)
            outbox.put(Reply(call.call_id, attr(*call.args, **call.kwargs) if callable(attr) else attr))
        except BaseException as exc:  # noqa: BLE001 - raised again in the API process
            outbox.put(Reply(call.call_id, error=_portable(exc)))

    calls = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="engine-call")
    try:
        while True:
            try:
                msg: ToEngine = conn.recv()
            except (EOFError, OSError):  # the API process is gone: stop with it
                break
            match msg:
                case Submit(request=request):
                    try:
                        engine.submit(request, on_finish)
                    except ValueError as exc:  # raced with an adapter unload; the API process checked the rest
                        outbox.put(Finished(_error_output(request, str(exc))))
                case Abort(request_id=request_id):
                    engine.abort(request_id)
                case RemoteCall():
                    calls.submit(run_call, msg)
                case Stop():
                    break
                case _:
                    logger.error("the engine process ignores an unknown message %r", msg)
    finally:
        calls.shutdown(wait=False, cancel_futures=True)
        engine.shutdown()
        outbox.put(None)
        sender.join(timeout=10)


def _static_info(engine: Any) -> dict[str, Any]:
    """What :class:`RemoteEngine` answers without asking (its sizes, device and dtype as text: they pickle)."""
    names = ("max_model_len", "vocab_size", "block_size", "num_blocks", "kv_cache_tokens", "max_num_seqs",
             "eos_token_ids", "general_path", "decode_backend", "gpu_uuid", "start_s", "start_parts_s")  # fmt: skip
    info = {n: getattr(engine, n) for n in names}
    info["device"], info["dtype"] = str(engine.device), str(engine.dtype).removeprefix("torch.")
    return info


# ---------------------------------------------------------------------- the API process's stand-in
class RemoteEngine:
    """Starts the engine process and forwards the engine's members (:class:`~asyncgrpo.server.engine.api.EngineAPI`).

    Args:
        model: checkpoint directory of the model (a path: it crosses to the engine process).
        settings: the engine's :class:`~asyncgrpo.server.engine.settings.EngineSettings`.
        receiver: the settings of the weight receiver built beside the engine (:meth:`weight_receiver`).
        start_timeout_s: bound on loading the model and capturing the graphs.
        wait: wait for the engine here; False: return once its process is started (the caller does its own start
            meanwhile) and call :meth:`wait_ready` before anything else.
    """

    # what the engine was built with, as its Ready message reports it (EngineAPI)
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    kv_cache_tokens: int
    max_num_seqs: int
    eos_token_ids: list[int]
    general_path: bool
    decode_backend: str
    device: torch.device
    dtype: torch.dtype
    gpu_uuid: str | None
    pid: int
    start_s: dict[str, float]  # the engine process's start phases (start_clock.py)
    start_parts_s: dict[str, dict[str, float]]  # their parts

    def __init__(
        self,
        model: str,
        settings: EngineSettings,
        receiver: ReceiverSettings,
        start_timeout_s: float = 1800.0,
        *,
        wait: bool = True,
    ) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_engine_main, name="asyncgrpo-engine", daemon=True,
                                 args=(child, str(model), settings, receiver, logging.getLogger().level))  # fmt: skip
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
        self._model, self._start_timeout_s, self._t0 = str(model), start_timeout_s, time.monotonic()
        self._ready = False
        self.pid = self._proc.pid
        self._receiver_settings = receiver
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Wait until the engine process has built its engine (within ``start_timeout_s`` of its start); raises its
        error (ValueError, RuntimeError, ...) if it failed. Idempotent."""
        if self._ready:
            return
        import torch

        info = self._wait_ready(self._start_timeout_s, self._model)
        for name, value in info.items():
            setattr(self, name, value)
        self.device = torch.device(info["device"])
        self.dtype = getattr(torch, info["dtype"])
        self.receiver = RemoteReceiver(self)
        self._reader = threading.Thread(target=self._read, name="engine-pipe-read", daemon=True)
        self._reader.start()
        self._ready = True

    def _wait_ready(self, timeout_s: float, model: str) -> dict[str, Any]:
        t0 = self._t0
        while True:
            waited = time.monotonic() - t0
            if self._conn.poll(min(LOG_EVERY_S, max(timeout_s - waited, 0.0))):
                try:
                    msg = self._conn.recv()
                except EOFError:
                    msg = Failed(ErrorInfo("RuntimeError", "the engine process closed its pipe"))
                if isinstance(msg, Ready):
                    return msg.info
                self._proc.join(timeout=30)
                raise _rebuild(msg.error)
            waited = time.monotonic() - t0
            if not self._proc.is_alive():
                raise RuntimeError(f"the engine process exited with code {self._proc.exitcode} while loading {model}")
            if waited >= timeout_s:
                self._proc.kill()
                raise TimeoutError(f"the engine process did not load {model} within {timeout_s:.0f} s")
            logger.info("waiting for the engine process to load %s (%.0f s so far)", model, waited)

    # ------------------------------------------------------------------ pipe
    def _send(self, msg: ToEngine) -> None:
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
            if isinstance(msg, Finished):
                out = msg.output
                with self._lock:
                    cb = self._callbacks.pop(out.request_id, None)
                    req = self._requests.pop(out.request_id, None)
                if out.prompt_token_ids is None:  # not sent back: it is the request's
                    out.prompt_token_ids = req.prompt_token_ids if req is not None else []
                if cb is not None:
                    cb(out)
            elif isinstance(msg, Reply):
                with self._lock:
                    fut = self._calls.pop(msg.call_id, None)
                if fut is None:
                    continue
                if msg.error is None:
                    fut.set_result(msg.value)
                else:
                    fut.set_exception(_rebuild(msg.error))
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
        self._send(RemoteCall(call_id, target, name, args, kwargs))
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
        """The engine process starts its engine itself (a member of EngineAPI: the in-process one needs it)."""

    def shutdown(self) -> None:
        self._stopping = True
        if not self._ready:  # still loading (the API side failed first): it reads no pipe before it is ready
            self._proc.kill()
            self._proc.join(timeout=LOG_EVERY_S)
            return
        try:
            self._send(Stop())
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
        self._send(Submit(request))

    def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._send(Abort(request_id))

    def pause(self, mode: PauseMode, timeout: float | None = None, *, clear_cache: bool = True) -> None:
        self.call("engine", "pause", mode, timeout, clear_cache=clear_cache)

    def resume(self) -> None:
        self.call("engine", "resume")

    def pause_future(self, mode: PauseMode, *, clear_cache: bool = True) -> concurrent.futures.Future:
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

    def stats(self) -> EngineStats:
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

    def weight_receiver(self, settings: ReceiverSettings) -> RemoteReceiver:
        """The receiver built beside the weights when the engine process started (with these settings)."""
        if settings != self._receiver_settings:
            raise ValueError(f"the engine process's weight receiver was built with {self._receiver_settings}, "
                             f"not {settings}")  # fmt: skip
        return self.receiver

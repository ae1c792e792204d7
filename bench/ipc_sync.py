"""B4-IPC: weight sync pause -> resume over CUDA IPC (server and trainer on one GPU), against a bare copy.

Run on one GPU (a couple of minutes on an H200, mostly writing and loading the 3.4 GB model):
    python bench/ipc_sync.py --out bench/results/ipc_sync_h200.json

In one run, one process holding a Qwen3-1.7B-shaped bf16 model (random init) on GPU 0:
1. bare: an on-device copy of the model's bytes into memory of the same process, (a) as one buffer and (b) one
   ``copy_`` per parameter tensor; median of ``--iters`` (CUDA events).
2. sync: one ``asyncgrpo serve`` on the same GPU serves the model; for each of ``--modes`` a ``WeightSender``
   (backend ``auto``: it must pick ``ipc`` from the server's GPU UUID) pushes this process's parameters with
   ``update_model`` (pause, start, update_weights per call, finish + reset prefix cache, resume); median of
   ``--iters`` rounds after ``--warmup``. ``unpacked`` shares every parameter where it lies (one call);
   ``packed:<MiB>`` copies into one buffer of that size, one call per chunk.

The JSON holds every timing, ``ratio`` = sync total / bare one-buffer copy, the goals (<= 4x the bare copy and
below the 19 ms of NCCL between two GPUs, B4 in bench/results/weight_sync_h200x2.json) and per mode the median
host steps (ms from the round's start: pause, start, updates, finish_and_reset, resume). Without CUDA it exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.weight_sync
from bench.result_file import write_result
from bench.weight_sync import QWEN3_1_7B, SMOKE, _bucket  # the shapes and modes of B4 over NCCL

NCCL_TWO_GPU_MS = 19.0  # B4 over NCCL between two H200s (the goal to beat)


def _timed(fn, iters: int, warmup: int) -> list[float]:
    """Seconds of each call of ``fn`` on the GPU (CUDA events), after ``warmup`` untimed calls."""
    out = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= warmup:
            out.append(start.elapsed_time(end) / 1e3)
    return out


def bare_copies(tensors: list[torch.Tensor], iters: int, warmup: int) -> dict:
    """The same bytes copied on the device: one flat buffer, then tensor by tensor into copies of each."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    bufs = [torch.empty(total, dtype=torch.uint8, device=tensors[0].device) for _ in range(2)]
    flat = _timed(lambda: bufs[1].copy_(bufs[0]), iters, warmup)
    bufs.clear()
    dsts = [torch.empty_like(t) for t in tensors]

    def each() -> None:
        for d, t in zip(dsts, tensors):
            d.copy_(t)

    per = _timed(each, iters, warmup)
    dsts.clear()
    torch.cuda.empty_cache()
    med = statistics.median(flat)
    return {"bytes": total, "one_buffer": {"median_s": med, "all_s": flat, "gb_per_s": 2 * total / med / 1e9},
            "per_tensor": {"median_s": statistics.median(per), "all_s": per, "tensors": len(tensors)}}  # fmt: skip


def sync_rounds(url: str, model: torch.nn.Module, mode: str, iters: int, warmup: int) -> dict:
    from asyncgrpo.client.http_client import AsyncServerClient
    from asyncgrpo.weights.sender import WeightSender

    packed, size = _bucket(mode)
    sender = WeightSender(timeout_s=300, packed_buffer_size_bytes=size)
    rounds, steps = [], []
    try:
        sender.init(AsyncServerClient(url), backend="auto", device="cuda:0", packed=packed)
        if sender.backend != "ipc":
            raise SystemExit(f"the sender chose {sender.backend!r}, not ipc, for a server on its own GPU")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for i in range(warmup + iters):
            t = sender.update_model(model, version=f"bench-{mode}-{i}")
            if i >= warmup:
                rounds.append(t)
                steps.append(dict(sender.last_breakdown))
        extra = torch.cuda.max_memory_allocated() - base
        server = _server_profile(sender)
        rtt = round_trips(sender)
    finally:
        sender.close()
    keys = [k for k, v in steps[0].items() if isinstance(v, float)]
    return {
        "rounds": rounds,
        "median": {k: statistics.median(r[k] for r in rounds) for k in rounds[0]},
        "host_steps_ms": {k: round(statistics.median(s[k] for s in steps), 3) for k in keys},
        "update_calls": steps[0].get("update_calls"),
        "packed_buffer_size_bytes": size if packed else None,
        "trainer_peak_extra_bytes": extra,
        "server_last_round": server,  # per update call, ms from its arrival in the engine process (new code only)
        "round_trips_ms": rtt,
    }


def _server_profile(sender) -> object:
    """The server's timings of the last round (``GET /weight_sync_profile``); None where it keeps none."""
    try:
        return sender._http(sender._client.request("GET", "/weight_sync_profile"), "GET /weight_sync_profile")
    except Exception as exc:  # noqa: BLE001 - the old code has no ipc timings: recorded as such
        return f"unavailable: {exc}"


def round_trips(sender, n: int = 30) -> dict:
    """Median ms of bare HTTP round trips through the sender's own client: ``/v1/models`` (API process only) and
    ``/weight_info`` (API process -> engine process -> back): the floor under each step of a round."""
    out = {}
    for path in ("/v1/models", "/weight_info"):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            sender._http(sender._client.request("GET", path), f"GET {path}")
            times.append((time.perf_counter() - t) * 1e3)
        out[path] = round(statistics.median(times), 3)
    return out


def run_baseline(args: argparse.Namespace) -> dict:
    """This script under ``--baseline-src`` (PYTHONPATH), in a child process, with ``--baseline-modes``."""
    import subprocess

    out = Path(tempfile.mkdtemp()) / "baseline.json"
    cmd = [sys.executable, __file__, "--out", str(out), "--iters", str(args.iters), "--warmup", str(args.warmup),
           "--modes", *args.baseline_modes, f"--server-args={args.server_args}"] + (["--smoke"] if args.smoke else [])  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(args.baseline_src.resolve()), os.environ.get("PYTHONPATH", "")]),
    }
    print(f"baseline: {' '.join(cmd[1:])} with PYTHONPATH={env['PYTHONPATH']}", flush=True)
    rc = subprocess.call(cmd, env=env)
    if rc != 0 or not out.is_file():
        return {"failed": f"exit {rc}"}
    report = json.loads(out.read_text())
    report["src"] = str(args.baseline_src)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="tiny model")
    ap.add_argument("--modes", nargs="*", default=["unpacked", "packed:1024", "packed:256", "packed:4096"])
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="also run this script against another checkout's src (e.g. the commit before a change), "
                         "first, in a child process; its report lands under 'baseline' (before/after in one call)")  # fmt: skip
    ap.add_argument("--baseline-modes", nargs="*", default=["unpacked", "packed:1024", "packed:256"])
    ap.add_argument("--server-args", default="", help="extra `asyncgrpo serve` flags")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("ipc_sync needs a CUDA device (server and trainer share it); no numbers made up", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, Qwen3Config

    from asyncgrpo.server.launcher import launch_server
    from asyncgrpo.weights.ipc import INSECURE_ENV
    from asyncgrpo.weights.policy import policy_weight_metadata

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    baseline = run_baseline(args) if args.baseline_src else None
    shape = SMOKE if args.smoke else QWEN3_1_7B
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.bfloat16)
    metas = policy_weight_metadata(model)
    report: dict = {
        "benchmark": "B4-IPC weight sync on one GPU (CUDA IPC)",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model_shape": "smoke" if args.smoke else "qwen3-1.7b",
        "dtype": "bfloat16",
        "tensors": len(metas),
        "bytes": sum(m.nbytes for m in metas),
        "iters": args.iters,
        "warmup": args.warmup,
        "goal": {"max_ratio_to_bare_copy": 4.0, "below_ms": NCCL_TWO_GPU_MS},
    }
    report["bare"] = bare_copies([p.detach() for p in model.parameters()], args.iters, args.warmup)
    bare = report["bare"]["one_buffer"]["median_s"]
    print(f"bare copy of {report['bytes'] / 1e9:.2f} GB: one buffer {bare * 1e3:.2f} ms, per tensor "
          f"{report['bare']['per_tensor']['median_s'] * 1e3:.2f} ms", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(Path(tmp) / "model")
        server_args = ["--device", "cuda:0", "--dtype", "bfloat16", "--max-model-len", "256",
                       "--gpu-memory-utilization", "0.3", *args.server_args.split()]  # fmt: skip
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        with launch_server(Path(tmp) / "model", extra_args=server_args, timeout=600,
                           env={"CUDA_VISIBLE_DEVICES": visible, INSECURE_ENV: "1"}) as server:  # fmt: skip
            report["sync"] = {}
            for mode in args.modes:
                r = sync_rounds(server.base_url, model, mode, args.iters, args.warmup)
                total = r["median"]["total_s"]
                r["ratio"] = total / bare
                r["meets_goal"] = r["ratio"] <= 4.0 and total * 1e3 < NCCL_TWO_GPU_MS
                report["sync"][mode] = r
                print(f"sync {mode}: total {total * 1e3:.2f} ms = {r['ratio']:.2f} x bare copy; "
                      f"{r['update_calls']} update call(s); steps {r['host_steps_ms']}", flush=True)  # fmt: skip
                if args.out:
                    write_result(args.out, report, indent=1)
    if baseline is not None:
        report["baseline"] = baseline
        report["speedup_vs_baseline"] = {
            m: baseline["sync"][m]["median"]["total_s"] / report["sync"][m]["median"]["total_s"]
            for m in report["sync"] if m in baseline.get("sync", {})
        }  # fmt: skip
    report["wall_s"] = time.perf_counter() - start
    if args.out:
        write_result(args.out, report, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

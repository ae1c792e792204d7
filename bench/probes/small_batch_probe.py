"""Decode step time against batch size, engine in process (why a GRPO run's first group is slow).

The worker runs its first group alone (G3): 8 requests decode 256 steps at batch 8. On an H200 at the
Qwen3-0.6B shape those steps took ~2.1 ms each against ~3.8 ms at batch 256, although a batch-8 forward
reads the same weights and far less KV. This probe times decode steps at several batch sizes, with and
without top-N log-probs, so the fixed per-step cost (host work, graph launch, sampler) stands out.

    python bench/probes/small_batch_probe.py --out small_batch_probe_h200.json
    py-spy record -r 2000 -f raw -o prof.txt -- python bench/probes/small_batch_probe.py --batches 8   # host profile
CPU smoke (tiny model; checks the script, not speed):  python bench/probes/small_batch_probe.py --tiny

``--http`` runs the same batches through ``asyncgrpo serve`` (engine process, top-N over the wire), once as b
single requests and once as one request with ``n`` = b, reading the engine's own step clock from
``/server_info``: the difference to the in-process figure is what the server adds per step.
``--py-spy DIR`` (with ``--http``) records the engine process and the API process during the batch-8 runs.
``--idle-s S`` times each batch once more after S idle seconds, as the worker's first group follows its start
(on an H200 the idle runs match the back-to-back ones: ``bench/LOG.md``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*
from bench.engine_run import submit_and_wait, synthetic_prompt
from bench.result_file import write_result
from bench.rollout_workload import QWEN3_06B, TINY, build_model_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batches", default="1,8,32,256")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--http", action="store_true", help="also run the batches through the server over HTTP")
    ap.add_argument("--py-spy", type=Path, default=None, help="with --http: write py-spy profiles (raw) here")
    ap.add_argument("--idle-s", type=float, default=0.0,
                    help="also time each batch once more after this many idle seconds (paths tagged _after_idle): "
                         "the worker's first group follows seconds of an idle server (the worker's start)")  # fmt: skip
    a = ap.parse_args()

    import torch

    from asyncgrpo.server.engine.engine import Engine
    from asyncgrpo.server.engine.request import Request, SamplingParams

    device = "cpu" if a.tiny else "cuda"
    shape = TINY if a.tiny else QWEN3_06B
    out_len = 8 if a.tiny else a.output_len
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(shape, device, "float32" if a.tiny else "bfloat16", Path(tmp) / "m")
        engine = Engine(str(model_dir), device=device, max_model_len=a.prompt_len + out_len + 16, max_num_seqs=256,
                        kv_cache_tokens=256 * (a.prompt_len + out_len + 16))  # fmt: skip
        engine.start()
        try:
            n = 0
            for logprobs in (8, 0):
                for b in [int(x) for x in a.batches.split(",")]:
                    for rep in range(3 if a.idle_s else 2):  # the first run of a size compiles what it needs
                        reqs = [Request(f"r{n}-{i}", synthetic_prompt(i, n, a.prompt_len),
                                        SamplingParams(max_tokens=out_len, min_tokens=out_len, ignore_eos=True,
                                                       temperature=1.0, logprobs=logprobs, seed=i))
                                for i in range(b)]  # fmt: skip
                        n += 1
                        engine.reset_prefix_cache()
                        if rep == 2:
                            time.sleep(a.idle_s)
                        before = engine.step_timings()
                        tokens, seconds = submit_and_wait(engine, reqs, f"b{b}", timeout=300)
                        after = engine.step_timings()
                        if rep == 0:
                            continue
                        row = _row("in_process" + _IDLE[rep], b, logprobs, tokens, seconds, before, after)
                        results.append(row)
                        print(json.dumps(row), flush=True)
        finally:
            engine.shutdown()
        if a.http:
            results += asyncio.run(_http_rows(a, model_dir, device, out_len))
    doc = {"benchmark": "decode step time against batch size (in process)", "shape": "tiny" if a.tiny else "qwen3-0.6b",
           "gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "time": time.strftime("%Y-%m-%d %H:%M"),
           "results": results}  # fmt: skip
    if a.out:
        write_result(a.out, doc, indent=1)
    return 0


_IDLE = ("", "", "_after_idle")  # path suffix per run: warm-up, back to back, after --idle-s


def _row(path: str, b: int, logprobs: int, tokens: int, seconds: float, before: dict, after: dict) -> dict:
    """One timed run from the engine's step clock before and after it."""
    steps = after["decode"]["steps"] - before["decode"]["steps"]
    dec_s = after["decode"]["seconds"] - before["decode"]["seconds"]
    pre_s = after["prefill"]["seconds"] - before["prefill"]["seconds"]
    return {"path": path, "batch": b, "logprobs": logprobs, "tokens": tokens, "seconds": seconds,
            "decode_steps": steps, "decode_ms_per_step": 1e3 * dec_s / max(steps, 1), "prefill_s": pre_s,
            "engine_busy_frac": (dec_s + pre_s) / seconds, "tok_per_s": tokens / seconds}  # fmt: skip


async def _http_rows(a: argparse.Namespace, model_dir: Path, device: str, out_len: int) -> list[dict]:
    """The batches over HTTP: b single requests, then one request for b choices (the worker's group request)."""
    from asyncgrpo.client.http_client import AsyncServerClient
    from asyncgrpo.server.launcher import launch_server

    max_len = a.prompt_len + out_len + 16
    args = ["--device", device, "--dtype", "float32" if a.tiny else "bfloat16", "--max-model-len", str(max_len),
            "--max-num-seqs", "256", "--kv-cache-tokens", str(256 * max_len), "--max-logprobs", "20"]  # fmt: skip
    server = launch_server(model_dir, extra_args=args, timeout=600)
    rows = []
    try:
        async with AsyncServerClient(server.base_url, max_connections=300, timeout=300) as client:
            engine_pid = (await client.server_info())["asyncgrpo"].get("engine_pid")
            n = 1000
            for logprobs in (8, 0):
                for b in [int(x) for x in a.batches.split(",")]:
                    for mode in ("requests", "n"):
                        for rep in range(3 if a.idle_s else 2):
                            n += 1
                            spy = _spy(a, engine_pid, server, b, logprobs, mode, rep)
                            params = {"max_tokens": out_len, "min_tokens": out_len, "ignore_eos": True,
                                      "temperature": 1.0, "logprobs": logprobs}  # fmt: skip
                            await client.reset_prefix_cache()
                            if rep == 2:
                                await asyncio.sleep(a.idle_s)
                            before = (await client.server_info())["asyncgrpo"]["engine_step_timings"]
                            t0 = time.perf_counter()
                            if mode == "n":
                                got = await client.complete_n(
                                    synthetic_prompt(0, n, a.prompt_len), {**params, "n": b, "seed": 1}
                                )
                            else:
                                got = list(await asyncio.gather(*(client.complete(synthetic_prompt(i, n, a.prompt_len),
                                                                                  {**params, "seed": i})
                                                                  for i in range(b))))  # fmt: skip
                            seconds = time.perf_counter() - t0
                            after = (await client.server_info())["asyncgrpo"]["engine_step_timings"]
                            for proc in spy:
                                proc.wait(timeout=120)
                            if rep == 0:
                                continue
                            tokens = sum(len(r.token_ids) for r in got)
                            row = _row(f"http_{mode}{_IDLE[rep]}", b, logprobs, tokens, seconds, before, after)
                            rows.append(row)
                            print(json.dumps(row), flush=True)
    finally:
        server.stop()
    return rows


def _spy(a: argparse.Namespace, engine_pid: int | None, server, b: int, logprobs: int, mode: str, rep: int) -> list:
    """py-spy recorders (engine process, API process) for the timed batch-8 runs with log-probs, if asked."""
    if a.py_spy is None or b != 8 or logprobs == 0 or rep == 0:
        return []
    a.py_spy.mkdir(parents=True, exist_ok=True)
    procs = []
    for name, pid in (("engine", engine_pid), ("api", server.proc.pid)):
        if pid is None:
            continue
        out = a.py_spy / f"{name}_{mode}.txt"
        cmd = [os.environ.get("PY_SPY", "py-spy"), "record", "-p", str(pid), "-r", "2000", "-d", "2", "-f", "raw",
               "--nonblocking", "-o", str(out)]  # fmt: skip
        with open(out.with_suffix(".log"), "w") as log:  # the child keeps its own descriptor
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
    time.sleep(0.5)  # let the recorders attach
    return procs


if __name__ == "__main__":
    sys.exit(main())

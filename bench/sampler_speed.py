"""Sampler time per decode step at the Qwen3 vocabulary (151936), bf16 logits, temperature 1, seeded rows.

Per batch size (8 and 256): ms per call as the engine pays it (host work and the one device->host copy included;
the split-vocabulary kernel path on CUDA) with logprobs None and 8 (the worker's top-8); on CUDA also the device
time of the two kernels alone (top-8, a CUDA graph of 20 calls) at each slice size and warp count, to check
``sample_kernel.choose_slice`` and the warps default, and without top-N. ``bench/generation.py`` records the same numbers in its B5 JSON.

Run (GPU):  python bench/sampler_speed.py --out bench/results/sampler_speed_h200.json
Smoke (CPU, interpreted kernel; checks the script, not speed):  TRITON_INTERPRET=1 python bench/sampler_speed.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from asyncgrpo.server.engine.request import SamplingParams
from asyncgrpo.server.engine.sampler import Sampler, SamplerRow
from asyncgrpo.server.layers import sample_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result

VOCAB = 151936
SWEEP = [(1024, 4), (2048, 8), (2048, 4), (4096, 16), (4096, 8), (8192, 16)]  # (slice, warps); default: slice/256


def sampler_bench(device: torch.device, vocab: int = VOCAB, batches: tuple[int, ...] = (8, 256)) -> dict:
    """{"batch_B": {"path", "logprobs_None_ms", "logprobs_8_ms"[, "default_slice", device ms by slice]}}."""
    out: dict = {}
    for batch in batches:
        logits = (torch.randn(batch, vocab, device=device) * 3).to(torch.bfloat16)
        sampler = Sampler(device)
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            sampler.use_kernel = True  # smoke: the interpreted kernel path
        res = out[f"batch_{batch}"] = {"path": "kernel" if sampler.use_kernel else "torch"}
        for lp in (None, 8):
            p = SamplingParams(max_tokens=8, temperature=1.0, seed=1, logprobs=lp)
            rows = [SamplerRow(params=p, num_output=i % 7) for i in range(batch)]
            res[f"logprobs_{lp}_ms"] = _call_ms(lambda: sampler(logits, rows), device)  # noqa: B023 (called now)
        print(f"batch {batch}: {res}", flush=True)
        if sampler.use_kernel and device.type == "cuda":
            ones, meta = torch.ones(batch, device=device), torch.zeros(4, batch, dtype=torch.int64, device=device)
            meta[3] = sample_kernel.MODE_SEEDED
            res["default_slice"] = sample_kernel.choose_slice(batch, vocab, sample_kernel._sm_count(device))
            try:  # device time only: a capture problem must not cost the per-call numbers above
                res["kernels_only_top0_device_ms_default"] = _graph_ms(
                    lambda: sample_kernel.fused_sample(logits, ones, meta, meta[0], 0)  # noqa: B023
                )
                res["kernels_only_top8_device_ms_by_slice_and_warps"] = {
                    f"{size}/{warps}": _graph_ms(
                        lambda: sample_kernel.fused_sample(logits, ones, meta, meta[0], 8, size, warps)  # noqa: B023
                    )
                    for size, warps in SWEEP
                }
            except RuntimeError as exc:
                res["kernels_only_error"] = repr(exc)
    print(f"sampler at vocab {vocab}:", json.dumps(out, indent=1))
    return out


def _call_ms(fn, device: torch.device, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000 / repeats


def _graph_ms(fn, repeats: int = 20) -> float:
    """Device time per call of ``fn`` without launch gaps: one CUDA graph of ``repeats`` calls, replayed."""
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    ap.add_argument("--smoke", action="store_true", help="CPU, vocab 1024, batches 2 and 4: checks the script only")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("the sampler timings need a CUDA GPU (use --smoke to check the script on CPU); nothing measured")
        return 2
    device = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    result = {
        "benchmark": "sampler ms per decode step",
        "smoke": args.smoke,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "torch": torch.__version__,
        "sampler_ms_per_call": sampler_bench(device, 1024, (2, 4)) if args.smoke else sampler_bench(device),
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

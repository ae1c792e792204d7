"""Garbage-collector pauses inside the engine during a B5-shaped run (in process).

The engine thread allocates per generated token; objects the collector tracks (tuples, lists) pile up in the
running sequences and set off collections that pause the step loop, full ones walking every live sequence.
This runs 256 requests x (128 + 256) tokens with top-8 log-probs through ``Engine`` and reports, per run, the
wall time, the seconds spent in collections and the count of full (generation-2) collections, read from
``gc.callbacks``.

    python bench/probes/engine_gc.py --tiny --out engine_gc_cpu.json   # tiny model on CPU
    python bench/probes/engine_gc.py --out engine_gc_h200.json         # Qwen3-0.6B shape on a GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*
from bench.engine_run import submit_and_wait, synthetic_prompt
from bench.result_file import write_result
from bench.rollout_workload import QWEN3_06B, TINY, build_model_dir


class GcClock:
    """Seconds in collections and full collections since :meth:`reset` (all threads of this process)."""

    def __init__(self) -> None:
        self.seconds, self.full, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += info["generation"] == 2

    def reset(self) -> None:
        self.seconds, self.full = 0.0, 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--logprobs", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()

    import torch

    from asyncgrpo.server.engine.engine import Engine
    from asyncgrpo.server.engine.request import Request, SamplingParams

    device = "cpu" if a.tiny else "cuda"
    shape = TINY if a.tiny else QWEN3_06B
    clock = GcClock()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model_dir(shape, device, "float32" if a.tiny else "bfloat16", Path(tmp) / "m")
        engine = Engine(str(model_dir), device=device, max_model_len=400, max_num_seqs=256,
                        kv_cache_tokens=256 * 400)  # fmt: skip
        engine.start()
        try:
            for rep in range(a.repeats + 1):  # the first run warms up
                reqs = [Request(f"r{rep}-{i}", synthetic_prompt(i, rep, 128),
                                SamplingParams(max_tokens=256, min_tokens=256, ignore_eos=True, temperature=1.0,
                                               logprobs=a.logprobs, seed=i))
                        for i in range(256)]  # fmt: skip
                engine.reset_prefix_cache()
                clock.reset()
                tokens, seconds = submit_and_wait(engine, reqs, "b5", timeout=900)
                if rep:
                    runs.append({"seconds": seconds, "tok_per_s": tokens / seconds, "gc_s": clock.seconds,
                                 "full_collections": clock.full})  # fmt: skip
                    print(json.dumps(runs[-1]), flush=True)
        finally:
            engine.shutdown()
    git = ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, check=False, capture_output=True, text=True).stdout.strip()
    doc = {"benchmark": "engine GC pauses, 256 x (128 + 256) tokens, in process (bench/probes/engine_gc.py)",
           "shape": "tiny" if a.tiny else "qwen3-0.6b", "logprobs": a.logprobs, "commit": commit,
           "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
           "python": platform.python_version(), "runs": runs}  # fmt: skip
    if a.out:
        write_result(a.out, doc, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a prefill step's time goes in the embedded engine (GRPO-group workload, one GPU).

A prefill step costs 15-25 ms on an H200 at the 0.6B shape whatever its token count (``bench/rollout_path.py``:
13 steps, 0.30 s for ~1.6 k computed tokens each, which is ~3 ms of matmul work). This probe runs the
rollout_path GRPO workload in process twice: once as shipped (step timings only), once with every prefill
stage fenced by device syncs so its wall time is attributed:

- ``admit``: the scheduler's admission (prefix-cache lookups, block allocation);
- ``prepare``: the runner's host work before the forward (metadata tensors, host->device copies);
- ``forward``: the decoder forward of the prefill tokens (and the LM head of the last positions);
- the rest of the step (``sampler_and_rest``): sampling the first token of each admitted sequence and the
  engine loop's bookkeeping.

Then a short ``torch.profiler`` run lists the operators by host time (decode steps replay CUDA graphs, so
the host operators are mostly the prefill's) and the summed device time of the kernels.

    python bench/probes/prefill_probe.py --out prefill_probe_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.*
from bench.result_file import write_result
from bench.rollout_workload import (
    QWEN3_06B,
    SHAPES,
    TINY,
    TINY_SHAPES,
    Req,
    _sync,
    build_model_dir,
    make_workload,
    run_engine,
)


class StageTimer:
    """Wraps the engine's prefill path with device syncs and sums the wall time of each stage."""

    def __init__(self, engine: Any) -> None:
        core = engine._core
        self.sched, self.runner, self.model = core.scheduler, core.runner, core.runner.model
        self.totals = {"admit": 0.0, "prepare": 0.0, "forward": 0.0}
        self._fwd = 0.0  # the forward's share of the prefill call in progress
        self.per_step: list[dict[str, float]] = []  # one entry per prefill step: its size and forward time
        self.steps, self.tokens, self.seqs, self.cached_rows = 0, 0, 0, 0
        self._orig = (self.sched._admit, self.runner.prefill, self.model.forward)
        self._in_prefill = False

    def install(self) -> None:
        admit, prefill, forward = self._orig
        timer = self

        def timed_admit() -> Any:
            t0 = time.perf_counter()
            out = admit()
            timer.totals["admit"] += time.perf_counter() - t0
            return out

        def timed_prefill(seqs: list, lora: bool = False) -> Any:
            _sync()
            t0 = time.perf_counter()
            timer._fwd = 0.0
            cached = sum(s.num_cached for s in seqs)  # reused prefix tokens, set at admission
            timer._in_prefill = True
            try:
                out = prefill(seqs, lora)
                _sync()
            finally:
                timer._in_prefill = False
            total = time.perf_counter() - t0
            tokens = sum(len(s.token_ids) for s in seqs)
            timer.per_step.append({"seqs": len(seqs), "computed_tokens": tokens - cached, "forward_ms": 1e3 * timer._fwd,
                                   "prepare_ms": 1e3 * (total - timer._fwd)})  # fmt: skip
            timer.totals["forward"] += timer._fwd
            timer.totals["prepare"] += total - timer._fwd
            timer.steps += 1
            timer.seqs += len(seqs)
            timer.tokens += tokens
            return out

        def timed_forward(input_ids: Any, positions: Any, batch: Any, caches: Any) -> Any:
            if not timer._in_prefill:
                return forward(input_ids, positions, batch, caches)
            _sync()
            t0 = time.perf_counter()
            out = forward(input_ids, positions, batch, caches)
            _sync()
            timer._fwd += time.perf_counter() - t0
            timer.cached_rows += 0 if batch.row_idx is None else int(batch.row_idx.numel())
            return out

        self.sched._admit = timed_admit
        self.runner.prefill = timed_prefill
        self.model.forward = timed_forward

    def uninstall(self) -> None:
        """Drop the instance-level wrappers: the class methods show through again."""
        self.sched.__dict__.pop("_admit", None)
        self.runner.__dict__.pop("prefill", None)
        self.model.__dict__.pop("forward", None)


def run(engine: Any, reqs: list[Req], tag: str, logprobs: int, timeout: float = 300.0) -> float:
    return run_engine(engine, reqs, tag, logprobs, timeout)[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--logprobs", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="tiny model on CPU: checks the script, not speed")
    opts = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from asyncgrpo.server.engine.engine import Engine

    if opts.tiny:
        model_shape, shape, device, dtype = TINY, TINY_SHAPES["grpo"], "cpu", "float32"
    elif not torch.cuda.is_available():
        print("prefill_probe needs a CUDA GPU (--tiny checks the script on CPU); nothing was measured.")
        return 2
    else:
        model_shape, shape, device, dtype = QWEN3_06B, SHAPES["grpo"], "cuda:0", "bfloat16"
    reqs = make_workload(shape, model_shape["vocab_size"], seed=1)
    max_len = -(-max(len(r.prompt) + r.out_len for r in reqs) // 16) * 16
    out: dict[str, Any] = {
        "benchmark": "prefill step breakdown",
        "shape": "grpo",
        "gpu": torch.cuda.get_device_name(0) if device != "cpu" else None,
    }
    with tempfile.TemporaryDirectory(prefix="prefill_probe_") as tmp:
        model_dir = build_model_dir(model_shape, device, dtype, Path(tmp) / "model")
        engine = Engine(model_dir, dtype=dtype, device=device, max_model_len=max_len, max_num_seqs=opts.max_num_seqs,
                        kv_cache_tokens=2 * opts.max_num_seqs * max_len if opts.tiny else None)  # fmt: skip
        engine.start()
        try:
            run(engine, reqs[:16], "warmup", opts.logprobs)
            engine.reset_prefix_cache()
            before = engine.step_timings()
            seconds = run(engine, reqs, "shipped", opts.logprobs)
            after = engine.step_timings()
            out["shipped"] = {"seconds": seconds, **{
                k: {"steps": after[k]["steps"] - before[k]["steps"],
                    "seconds": after[k]["seconds"] - before[k]["seconds"]} for k in ("prefill", "decode")}}  # fmt: skip
            engine.reset_prefix_cache()
            timer = StageTimer(engine)
            timer.install()
            before = engine.step_timings()
            try:
                out["fenced_seconds"] = run(engine, reqs, "fenced", opts.logprobs)
            finally:
                timer.uninstall()
            after = engine.step_timings()
            step_s = after["prefill"]["seconds"] - before["prefill"]["seconds"]
            staged = sum(timer.totals.values())
            out["fenced"] = {"prefill_steps": timer.steps, "prefill_step_s": step_s, **timer.totals,
                             "sampler_and_rest": step_s - staged, "seqs": timer.seqs, "tokens": timer.tokens,
                             "cached_rows": timer.cached_rows, "per_step": timer.per_step,
                             "ms_per_step": {k: 1e3 * v / max(timer.steps, 1) for k, v in timer.totals.items()}}  # fmt: skip
            engine.reset_prefix_cache()
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
            prof = profile(activities=acts)
            # the engine's ops run on its own thread: the profiler starts and stops there, between two steps
            engine.run_between_steps(prof.__enter__, timeout=60)
            try:
                run(engine, reqs[:128], "profiled", opts.logprobs)
            finally:
                engine.run_between_steps(lambda: prof.__exit__(None, None, None), timeout=120)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35)
            out["profile_device_ms"] = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
            out["profile_host_ms"] = sum(e.self_cpu_time_total for e in prof.key_averages()) / 1e3
            out["profile_top_host_ops"] = table
            print(table)
        finally:
            engine.shutdown()
    print(json.dumps({k: v for k, v in out.items() if k != "profile_top_host_ops"}, indent=1))
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        write_result(opts.out, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

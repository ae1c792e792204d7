"""B5: generated tokens/s of the embedded engine against HF ``generate``, same process, same model.

A random-init Qwen3-0.6B-shaped model (bf16, built directly on the GPU) answers
256 concurrent requests: 128 random prompt tokens, exactly 256 output tokens
(ignore_eos + min_tokens), temperature 1.0. The engine gets all requests at once
through its public API (submit all, wait for all); the baseline is one HF
``model.generate`` call at batch 256 with the same shapes and sampling.

Run (GPU):  python bench/generation.py --out bench/results/generation_h200.json [--profile]
A second run at the GRPO-group shape (64 prompts x 8 equal requests, 32 output tokens) reports the prefill
tokens computed against the unique prompt tokens (prefix caching).
The sampler timings (batch 8 and 256, logprobs None and 8) come from bench/sampler_speed.py, also runnable alone.
Smoke (CPU, tiny shapes, only checks that the script runs):  python bench/generation.py --smoke
"""

from __future__ import annotations

import argparse
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.engine_run, bench.sampler_speed
from bench.engine_run import submit_and_wait
from bench.probes.profile_table import events_of, format_table, summarize
from bench.result_file import write_result

QWEN3_06B = {
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
}
SMOKE = {**QWEN3_06B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "intermediate_size": 128, "vocab_size": 1024}  # fmt: skip


def build_model(shape: dict, device: torch.device, dtype: torch.dtype):
    """Random-init Qwen3 model created on ``device`` directly (no CPU init + copy)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def run_engine(engine: Engine, prompts: list[list[int]], output_len: int, tag: str) -> tuple[int, float]:
    """Submit every prompt at once, wait for all; returns (generated tokens, seconds)."""
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, ignore_eos=True, temperature=1.0)
    return submit_and_wait(engine, [Request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)], tag, 600)


def run_groups(
    engine: Engine, shape: dict, num_prompts: int, group: int, prompt_len: int, output_len: int, gen: torch.Generator
) -> dict:
    """GRPO-group shape: ``num_prompts`` prompts x ``group`` equal requests, all submitted at once. Reports the
    prefill tokens computed against the unique prompt tokens (prefix caching shares each group's prompt)."""
    base = torch.randint(2, shape["vocab_size"], (num_prompts, prompt_len), generator=gen).tolist()
    prompts = [p for p in base for _ in range(group)]
    before = engine.stats()
    tokens, seconds = run_engine(engine, prompts, output_len, "grpo")
    after = engine.stats()
    computed = after.prefill_tokens_computed_total - before.prefill_tokens_computed_total
    unique = num_prompts * prompt_len
    return {
        "num_prompts": num_prompts,
        "group_size": group,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "unique_prompt_tokens": unique,
        "prefill_tokens_computed": computed,
        "computed_over_unique": computed / unique,
        "prefix_cache_queries": after.prefix_cache_queries_total - before.prefix_cache_queries_total,
        "prefix_cache_hits": after.prefix_cache_hits_total - before.prefix_cache_hits_total,
    }


def run_hf(model, prompts: list[list[int]], output_len: int, device: torch.device) -> tuple[int, float]:
    ids = torch.tensor(prompts, device=device)
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=1,
        )
    _sync(device)
    seconds = time.perf_counter() - start
    return int(out.shape[0] * (out.shape[1] - ids.shape[1])), seconds


def profile_eager(
    model, prompts, dtype, device, max_len: int, out: Path | None, eager: bool = True, output_len: int = 32
) -> dict:
    """A run of ``output_len`` tokens under torch.profiler: where device time goes. ``eager``: no CUDA graphs
    (kernel names per op); otherwise the graph-mode engine, whose summed kernel time per decode step, against the
    wall time per step, shows how long the GPU waits for the host (at the benchmark's full output length, so the
    attention's share is the timed runs' one)."""
    from torch.profiler import ProfilerActivity, profile

    tag = "eager" if eager else "graphs"
    engine = Engine(
        model, dtype=str(dtype).removeprefix("torch."), device=str(device), max_model_len=max_len,
        max_num_seqs=len(prompts), kv_cache_tokens=len(prompts) * max_len, enforce_eager=eager,
    )  # fmt: skip
    engine.start()
    run_engine(engine, prompts, 8, f"{tag}-warmup")
    engine.reset_prefix_cache()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    before = engine.step_timings()
    with profile(activities=activities) as prof:
        tokens, seconds = run_engine(engine, prompts, output_len, f"{tag}-profiled")
    after = engine.step_timings()
    timings = {k: {m: after[k][m] - before[k][m] for m in after[k]} for k in after}
    engine.shutdown()
    del engine
    _free(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=key, row_limit=30)
    except (KeyError, AttributeError, RuntimeError):
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=30)
    device_us = sum(getattr(e, "self_device_time_total", 0.0) or 0.0 for e in prof.key_averages())
    steps = sum(t["steps"] for t in timings.values())
    summary = summarize(events_of(prof), steps, sum(t["seconds"] for t in timings.values()))
    print(format_table(f"engine step ({tag})", summary))
    if out is not None:
        path = out.with_name(out.stem + f"_{tag}_profile.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(table)
    print(table)
    wall_ms = 1000 * sum(t["seconds"] for t in timings.values()) / max(steps, 1)
    print(f"{tag}: {steps} steps, wall {wall_ms:.2f} ms/step, device kernels {device_us / 1000 / max(steps, 1):.2f} "
          "ms/step (under the profiler)")  # fmt: skip
    return {
        "tokens": tokens,
        "seconds_under_profiler": seconds,
        "step_timings": timings,
        "device_kernel_ms_per_step": device_us / 1000 / max(steps, 1),
        "wall_ms_per_step": wall_ms,
        "categories": summary,  # bench/probes/profile_table.py: time by kind of work, launches, syncs
    }


def kernel_sweep(device: torch.device, dtype: torch.dtype, shape: dict, batch: int) -> list[dict]:
    """Time the decode kernel alone (GB/s of K+V read) at the benchmark's batch and three context lengths, with
    randomly scattered blocks: how close the kernel is to the memory bound (B5's mean context is 256)."""
    from asyncgrpo.server.layers.decode_kernel import paged_decode

    hkv, d = shape["num_key_value_heads"], shape["head_dim"]
    group, bs = shape["num_attention_heads"] // hkv, 16
    rows = []
    for ctx in (256, 1024, 4096):
        blocks = -(-ctx // bs)
        k = torch.randn(batch * blocks + 1, bs, hkv, d, device=device, dtype=dtype)
        v = torch.randn_like(k)
        q = torch.randn(batch, hkv * group, d, device=device, dtype=dtype)
        tables = torch.randperm(batch * blocks, device=device).view(batch, blocks)
        lens = torch.full((batch,), ctx, device=device)
        for _ in range(3):
            paged_decode(q, k, v, tables, lens, d**-0.5)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(20):
            paged_decode(q, k, v, tables, lens, d**-0.5)
        torch.cuda.synchronize(device)
        us = (time.perf_counter() - start) / 20 * 1e6
        gbps = 2 * batch * ctx * hkv * d * q.element_size() / us / 1e3
        rows.append({"batch": batch, "context": ctx, "us": us, "GBps": gbps})
        print(f"decode kernel alone B={batch} ctx={ctx}: {us:7.1f} us {gbps:6.0f} GB/s")
        del k, v
    return rows


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU; checks the script, not speed")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--engine-repeats", type=int, default=3)
    ap.add_argument("--hf-repeats", type=int, default=2)
    ap.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="also run a short eager engine under torch.profiler and print/write its top kernels",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    ap.add_argument("--no-sweep", action="store_true", help="skip the decode kernels' sweep")
    ap.add_argument("--no-look-ahead", action="store_true", help="step synchronously (no decode step ahead)")
    ap.add_argument("--groups", type=int, default=None, help="GRPO-group run: number of prompts (default 64)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    if args.smoke:
        device, dtype, shape, defaults = torch.device("cpu"), torch.float32, SMOKE, (8, 16, 16)
    else:
        if not torch.cuda.is_available():
            print("B5 needs a CUDA GPU (use --smoke to check the script on CPU); no numbers were measured.")
            return 2
        device, dtype, shape, defaults = torch.device("cuda", 0), torch.bfloat16, QWEN3_06B, (256, 128, 256)
    n_req = args.num_requests or defaults[0]
    p_len = args.prompt_len or defaults[1]
    o_len = args.output_len or defaults[2]

    t0 = time.perf_counter()
    model = build_model(shape, device, dtype)
    model_init_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(2, shape["vocab_size"], (n_req, p_len), generator=gen).tolist()

    # ---------------------------------------------------------------- engine
    t0 = time.perf_counter()
    engine = Engine(
        model, dtype=str(dtype).removeprefix("torch."), device=str(device), max_model_len=p_len + o_len,
        max_num_seqs=n_req, kv_cache_tokens=n_req * (p_len + o_len),
    )  # fmt: skip
    engine_init_s = time.perf_counter() - t0
    engine.look_ahead = not args.no_look_ahead
    backend = engine.decode_backend
    print(f"engine decode backend: {backend}")
    engine.start()
    run_engine(engine, prompts, min(o_len, 16), "warmup")
    before = engine.step_timings()
    engine_runs = []
    for r in range(args.engine_repeats):
        engine.reset_prefix_cache()  # each timed run prefills its prompts (the same prompts every run)
        engine_runs.append(run_engine(engine, prompts, o_len, f"run{r}"))
    after = engine.step_timings()
    steps = {
        k: {"steps": after[k]["steps"] - before[k]["steps"], "seconds": after[k]["seconds"] - before[k]["seconds"]}
        for k in after
    }
    stats = engine.stats()
    kv_tokens = engine.kv_cache_tokens
    grpo = run_groups(engine, shape, args.groups or (4 if args.smoke else 64), 8, p_len, min(o_len, 32), gen)
    engine.shutdown()
    del engine
    _free(device)
    profile = graph_profile = None
    if args.profile:
        profile = profile_eager(model, prompts, dtype, device, p_len + o_len, args.out)
        _free(device)
        graph_profile = profile_eager(model, prompts, dtype, device, p_len + o_len, args.out, False, o_len)

    sweep = kernel_sweep(device, dtype, shape, n_req) if device.type == "cuda" and not args.no_sweep else None
    from bench.sampler_speed import sampler_bench

    sampler_ms = sampler_bench(device, shape["vocab_size"], (2, 4) if args.smoke else (8, 256))
    _free(device)

    # -------------------------------------------------------------- baseline
    hf_runs: list[tuple[int, float]] = []  # --no-hf: no baseline, and no ratio either
    if not args.no_hf:
        run_hf(model, prompts, 4, device)  # warm-up
        hf_runs = [run_hf(model, prompts, o_len, device) for _ in range(args.hf_repeats)]

    # ---------------------------------------------------------------- report
    eng_tps = statistics.median(t / s for t, s in engine_runs)
    hf_tps = statistics.median(t / s for t, s in hf_runs) if hf_runs else None
    result = {
        "benchmark": "B5 embedded engine generation throughput",
        "smoke": args.smoke,
        "inputs": {
            "num_requests": n_req,
            "prompt_len": p_len,
            "output_len": o_len,
            "temperature": 1.0,
            "dtype": str(dtype),
            "model_shape": shape,
        },
        "machine": {
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "engine": {
            "runs": [{"tokens": t, "seconds": s, "tokens_per_s": t / s} for t, s in engine_runs],
            "median_tokens_per_s": eng_tps,
            "init_seconds": engine_init_s,
            "decode_backend": backend,
            "look_ahead": not args.no_look_ahead,
            "kv_cache_tokens": kv_tokens,
            "num_preemptions_total": stats.num_preemptions_total,
            "step_timings_timed_runs": steps,
            "decode_ms_per_step": 1000 * steps["decode"]["seconds"] / max(steps["decode"]["steps"], 1),
            "prefill_tokens_computed_total": stats.prefill_tokens_computed_total,
            "prefix_cache_queries_total": stats.prefix_cache_queries_total,
            "prefix_cache_hits_total": stats.prefix_cache_hits_total,
        },
        "grpo_groups": grpo,
        "eager_profile": profile,
        "graph_profile": graph_profile,
        "decode_kernel_sweep": sweep,
        "sampler_ms_per_call": sampler_ms,
        "hf_generate": {
            "runs": [{"tokens": t, "seconds": s, "tokens_per_s": t / s} for t, s in hf_runs],
            "median_tokens_per_s": hf_tps,
        },
        "model_init_seconds": model_init_s,
        "ratio_engine_over_hf": eng_tps / hf_tps if hf_tps else None,
    }
    print(f"\nB5 generation, {n_req} requests x ({p_len} prompt + {o_len} output), {result['machine']['gpu'] or 'CPU'}")
    print(f"{'':16}{'tokens':>10}{'seconds':>10}{'tok/s':>12}")
    for name, runs, tps in (("engine", engine_runs, eng_tps), ("HF generate", hf_runs, hf_tps)):
        if not runs:
            continue
        t, s = runs[len(runs) // 2]
        print(f"{name:16}{t:>10}{s:>10.2f}{tps:>12.0f}")
    dec = steps["decode"]
    if dec["steps"]:
        print(f"engine decode steps: {dec['steps']}, {1000 * dec['seconds'] / dec['steps']:.2f} ms each (timed runs)")
    print(
        f"GRPO groups {grpo['num_prompts']} x {grpo['group_size']}: prefill computed {grpo['prefill_tokens_computed']} "
        f"for {grpo['unique_prompt_tokens']} unique prompt tokens ({grpo['computed_over_unique']:.2f}x), "
        f"hits {grpo['prefix_cache_hits']}, {grpo['tokens_per_s']:.0f} generated tok/s"
    )
    if hf_tps:
        print(
            f"ratio engine / HF generate: {eng_tps / hf_tps:.1f}x"
            + ("  (smoke run: not a measurement)" if args.smoke else "")
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

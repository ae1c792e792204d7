"""The B5-HTTP workload (bench/rollout_path.py): shapes, requests, the random-init model and the in-process engine run."""

from __future__ import annotations

import argparse
import gc
import logging
import random
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from asyncgrpo.client.metrics_text import vllm_metrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.*
from bench.engine_run import submit_and_wait

logger = logging.getLogger("rollout_path")


QWEN3_06B = {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
             "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
             "max_position_embeddings": 40960}  # fmt: skip
TINY = {**QWEN3_06B, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "vocab_size": 1024}  # fmt: skip
# name -> (groups, G, prompt_len range, output_len range, distinct prompts within a group)
SHAPES = {"b5": (32, 8, (128, 128), (256, 256), True), "grpo": (64, 8, (128, 512), (8, 256), False),
          "grpo_n": (64, 8, (128, 512), (8, 256), False)}  # fmt: skip
TINY_SHAPES = {"b5": (2, 4, (16, 16), (16, 16), True), "grpo": (2, 4, (8, 32), (2, 16), False),
               "grpo_n": (2, 4, (8, 32), (2, 16), False)}  # fmt: skip
GROUP_LENGTH_SHAPES = {"grpo_n"}  # one output length per group: the worker_group variant runs on these
SERVED_NAME = "bench"


@dataclass
class Req:
    prompt: list[int]
    out_len: int
    group: int


def make_workload(shape: tuple, vocab: int, seed: int, group_length: bool = False) -> list[Req]:
    """Requests of one shape; GRPO groups share their prompt (and with ``group_length`` their output length),
    B5's 'groups' hold distinct prompts."""
    groups, g, (p_lo, p_hi), (o_lo, o_hi), distinct = shape
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randrange(2, vocab) for _ in range(rng.randint(p_lo, p_hi))]

    reqs = []
    for grp in range(groups):
        shared, length = prompt(), rng.randint(o_lo, o_hi)
        reqs += [Req(prompt() if distinct else shared, length if group_length else rng.randint(o_lo, o_hi), grp)
                 for _ in range(g)]  # fmt: skip
    return reqs


def build_model_dir(shape: dict, device: str, dtype: str, path: Path) -> Path:
    """Random-init Qwen3 model saved to ``path`` (built on ``device`` directly; no tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(**shape, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.save_pretrained(path)
    del model
    _free()
    return path


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timing_delta(before: dict, after: dict) -> dict[str, float]:
    out = {f"{k}_s": after[k]["seconds"] - before.get(k, {}).get("seconds", 0.0) for k in after} | {
        f"{k}_steps": after[k]["steps"] - before.get(k, {}).get("steps", 0) for k in after
    }
    if "steps_ahead" in after.get("decode", {}):  # decode steps launched before the previous step's results
        out["decode_steps_ahead"] = after["decode"]["steps_ahead"] - before.get("decode", {}).get("steps_ahead", 0)
    return out


# ---------------------------------------------------------------------- variant 1: engine in process


def run_engine(engine: Any, reqs: list[Req], tag: str, logprobs: int, timeout: float) -> tuple[int, float]:
    """Submit every request to an in-process engine at once and wait for all: (generated tokens, seconds)."""
    from asyncgrpo.server.engine.request import Request, SamplingParams

    requests = [Request(f"{tag}-{i}", list(r.prompt), SamplingParams(
        max_tokens=r.out_len, min_tokens=r.out_len, ignore_eos=True, temperature=1.0, logprobs=logprobs, seed=i))
        for i, r in enumerate(reqs)]  # fmt: skip
    return submit_and_wait(engine, requests, f"in-process {tag}", timeout)


class Occupancy:
    """The engine's running and waiting counts, read every ``interval_s`` by a thread while a timed run goes:
    whether the batch stays full (in process every request waits from the start; through the worker, requests
    stream in as groups end, and a server whose queue runs dry decodes smaller batches)."""

    def __init__(self, read: Any, interval_s: float = 0.02) -> None:
        self.read, self.interval_s = read, interval_s
        self.samples: list[tuple[int, int]] = []
        self.failed_reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="occupancy", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(self.read())
            except Exception:  # noqa: BLE001 - a failed read loses one sample (counted), never the run
                self.failed_reads += 1

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def summary(self) -> dict[str, float]:
        """Means over the samples taken while anything ran or waited (the idle start and end left out)."""
        busy = [(r, w) for r, w in self.samples if r or w]
        if not busy:
            return {}
        n = len(busy)
        return {"occupancy_running_mean": sum(r for r, _ in busy) / n, "occupancy_waiting_mean": sum(w for _, w in busy) / n,
                "occupancy_waiting_zero_frac": sum(1 for _, w in busy if w == 0) / n, "occupancy_samples": n,
                "occupancy_failed_reads": self.failed_reads}  # fmt: skip


def _engine_counts(engine: Any) -> tuple[int, int]:
    """Running and waiting requests of an engine in this process, from one ``stats()`` read."""
    stats = engine.stats()
    return stats.num_running, stats.num_waiting


def _server_counts(base_url: str) -> tuple[int, int]:
    """Running and waiting requests from the server's Prometheus text (a blocking read: the sampler's thread)."""
    import urllib.request

    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as resp:
        found = vllm_metrics(resp.read().decode())
    return int(found.get("vllm:num_requests_running", 0)), int(found.get("vllm:num_requests_waiting", 0))


def run_in_process(model_dir: Path, opts: argparse.Namespace, workloads: dict[str, list[Req]]) -> dict[str, Any]:
    from asyncgrpo.server.engine.engine import Engine

    engine = Engine(model_dir, dtype=opts.dtype, device=opts.device, max_model_len=opts.max_model_len,
                    max_num_seqs=opts.max_num_seqs, kv_cache_tokens=opts.kv_cache_tokens)  # fmt: skip
    opts.in_process_kv_cache_tokens = engine.kv_cache_tokens
    core = engine._core
    sampler_s = [0.0]
    inner = core.sampler

    class TimedSampler:
        """The engine's sampler with a timer: a blocking call, or a launch plus its later ``result()``."""

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def __call__(self, logits: Any, rows: Any) -> Any:
            _sync()  # the forward's kernels finish first, so the timer holds only the sampler
            t0 = time.perf_counter()
            out = inner(logits, rows)
            sampler_s[0] += time.perf_counter() - t0
            return out

        def launch(self, logits: Any, rows: Any) -> Any:
            _sync()
            t0 = time.perf_counter()
            pending = inner.launch(logits, rows)
            sampler_s[0] += time.perf_counter() - t0
            result = pending.result

            def timed_result() -> Any:
                t1 = time.perf_counter()
                out = result()
                sampler_s[0] += time.perf_counter() - t1
                return out

            pending.result = timed_result
            return pending

    engine.start()

    def run(reqs: list[Req], tag: str) -> tuple[int, float]:
        return run_engine(engine, reqs, tag, opts.logprobs, _remaining())

    try:
        run(_warmup(workloads), "warmup")
        results = {}
        for name, reqs in workloads.items():
            engine.reset_prefix_cache()
            run(reqs, f"{name}-warmup")  # untimed: every shape this workload meets is compiled once
            rows = []
            for rep in range(opts.repeats):  # timed runs: the engine exactly as shipped, no syncs added
                engine.reset_prefix_cache()  # each run prefills its prompts: no hits left by the run before
                before = engine.step_timings()
                with Occupancy(lambda: _engine_counts(engine)) as occ:
                    tokens, seconds = run(reqs, f"{name}-{rep}")
                rows.append(_row(reqs, tokens, seconds, _timing_delta(before, engine.step_timings()) | occ.summary()))
            results[name] = _median_row(rows)
            # One extra, untimed run with the sampler timer: its syncs break the engine's overlap of the sampler
            # with the next forward, so it only says how long the sampler itself takes.
            core.sampler, s0 = TimedSampler(), sampler_s[0]
            engine.reset_prefix_cache()
            try:
                run(reqs, f"{name}-profile")
            finally:
                core.sampler = inner
            results[name]["stages"]["sampler_s_profiled_run"] = sampler_s[0] - s0
        results["decode_backend"] = engine.decode_backend
        return results
    finally:
        engine.shutdown()
        core.sampler = inner


def _median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median throughput (the lower middle one of an even count; its stages with it), plus every
    run's tokens and seconds. Every variant is summarised the same way."""
    ordered = sorted(rows, key=lambda r: r["generated_tok_per_s"])
    median = dict(ordered[(len(ordered) - 1) // 2])
    median["runs"] = [{"generated_tokens": r["generated_tokens"], "seconds": r["seconds"]} for r in rows]
    return median


def _warmup(workloads: dict[str, list[Req]]) -> list[Req]:
    first = next(iter(workloads.values()))
    return [Req(r.prompt, min(r.out_len, 8), r.group) for r in first[:16]]


def _row(reqs: list[Req], tokens: int, seconds: float, stages: dict[str, float]) -> dict[str, Any]:
    expected = sum(r.out_len for r in reqs)
    if tokens != expected:
        raise RuntimeError(f"generated {tokens} tokens but the requests fix {expected}")
    derived = {}
    if stages.get("decode_steps"):
        derived["decode_ms_per_step"] = 1e3 * stages["decode_s"] / stages["decode_steps"]
        derived["decode_tokens_per_step"] = tokens / stages["decode_steps"]
    if "decode_s" in stages:  # the share of the wall time the engine spent in steps (the rest: idle or waiting)
        derived["engine_busy_frac"] = (stages["decode_s"] + stages.get("prefill_s", 0.0)) / seconds
    return {"requests": len(reqs), "prompt_tokens": sum(len(r.prompt) for r in reqs), "generated_tokens": tokens,
            "seconds": seconds, "generated_tok_per_s": tokens / seconds, "stages": stages, "derived": derived}  # fmt: skip


# ---------------------------------------------------------------------- variant 2: server over HTTP


_DEADLINE = [float("inf")]


def _remaining() -> float:
    left = _DEADLINE[0] - time.monotonic()
    if left <= 0:
        raise TimeoutError("the run passed --max-seconds")
    return left

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
import contextvars
import gc
import logging
import os
import platform
import random
import shlex
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from asyncgrpo.client.answer_parse import AnswerParsers, default_parse_processes
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.client.metrics_text import vllm_metrics
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.sampling import SamplingSettings
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.types import Rollout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.engine_run
from bench.engine_run import submit_and_wait
from bench.result_file import write_result

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
    from asyncgrpo.server.request import Request, SamplingParams

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
    from asyncgrpo.server.engine import Engine

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


def _sampling(base_url: str, opts: argparse.Namespace, cls: type = SamplingSettings) -> SamplingSettings:
    return cls(base_url=base_url, max_model_len=opts.max_model_len, max_completion_length=opts.max_model_len,
               temperature=1.0, num_sampler_logprobs=opts.logprobs, kv_cache_tokens=opts.server_kv_cache_tokens,
               has_metrics=True, initial_tokens_per_step=10**12)  # fmt: skip


async def _server_kv_tokens(base_url: str) -> int | None:
    async with AsyncServerClient(base_url) as client:
        return await client.kv_cache_tokens()


async def _server_stages(client: AsyncServerClient) -> dict[str, Any]:
    ours = (await client.server_info())["asyncgrpo"]
    gen = (await client.metrics()).get("vllm:generation_tokens_total", 0.0)
    return {"timings": ours.get("engine_step_timings", {}), "http": ours.get("http_stats", {}), "gen_tokens": gen}


def _tail_s(after: dict, end_unix: float) -> float:
    """Wall seconds from the engine's last step to ``end_unix`` (the answer path's tail after the GPU work)."""
    last = _last_step_unix(after)
    return end_unix - last if last else float("nan")


def _last_step_unix(after: dict) -> float:
    return max((t.get("last_end_unix", 0.0) for t in after["timings"].values()), default=0.0)


def _tail_split(after: dict, end_unix: float) -> dict[str, float]:
    """The tail after the engine's last step in three parts: until the last answer's outputs reached the API
    process, building that answer's bytes, and the rest (sending, the client's parse, handing results over)."""
    last, http = _last_step_unix(after), after["http"]
    outputs, built = http.get("last_outputs_unix", 0.0), http.get("last_built_unix", 0.0)
    if not (last and outputs and built):
        return {}
    return {
        "tail_engine_to_api_s": outputs - last,
        "tail_build_s": built - outputs,
        "tail_after_build_s": end_unix - built,
    }


def _server_delta(before: dict, after: dict) -> dict[str, float]:
    out = _timing_delta(before["timings"], after["timings"])
    out["server_response_build_s"] = after["http"].get("response_build_s", 0.0) - before["http"].get(
        "response_build_s", 0.0
    )
    return out


async def _http_run(base_url: str, opts: argparse.Namespace, reqs: list[Req], parsers: AnswerParsers
                    ) -> tuple[int, float, dict]:  # fmt: skip
    sampling = _sampling(base_url, opts)
    async with AsyncServerClient(base_url, max_connections=len(reqs) + 4, timeout=_remaining(),
                                 answer_parsers=parsers) as client:  # fmt: skip
        await client.reset_prefix_cache()  # each run prefills its prompts: no hits left by the run before
        before = await _server_stages(client)

        async def one(i: int, r: Req) -> int:
            params = sampling.request_params(len(r.prompt), seed=i)
            params.update(max_tokens=r.out_len, min_tokens=r.out_len, ignore_eos=True)
            return len((await client.complete(r.prompt, params, model=SERVED_NAME)).token_ids)

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))))
        seconds, end_unix = time.perf_counter() - t0, time.time()
        after = await _server_stages(client)
        stages = _server_delta(before, after) | {
            "client_parse_s": getattr(client, "parse_seconds", 0.0),
            "tail_after_last_step_s": _tail_s(after, end_unix),
            **_tail_split(after, end_unix),
        }
    return tokens, seconds, stages


def run_http(base_url: str, opts: argparse.Namespace, workloads: dict[str, list[Req]]) -> dict[str, Any]:
    return asyncio.run(_http_all(base_url, opts, workloads))


async def _http_all(base_url: str, opts: argparse.Namespace, workloads: dict[str, list[Req]]) -> dict[str, Any]:
    """Every HTTP run in one event loop, with the answer-parsing helpers the rollout worker's client has."""
    parsers = AnswerParsers(opts.answer_parse_processes)
    try:
        await parsers.wait_ready()
        await _http_run(base_url, opts, _warmup(workloads), parsers)
        results: dict[str, Any] = {"answer_parse_processes": parsers.processes}
        for name, reqs in workloads.items():
            await _http_run(base_url, opts, reqs, parsers)  # untimed warm-up of this shape
            rows = [_row(reqs, *await _http_run(base_url, opts, reqs, parsers)) for _ in range(opts.repeats)]
            results[name] = _median_row(rows)
        return results
    finally:
        await parsers.close()


# ---------------------------------------------------------------------- variant 3: the rollout worker

_OUT_LEN: contextvars.ContextVar[int] = contextvars.ContextVar("bench_out_len")


class FixedLengthSampling(SamplingSettings):
    """The worker's request parameters, with this request's fixed output length (``min_tokens`` + ``ignore_eos``)."""

    def request_params(self, prompt_len: int, seed: int) -> dict[str, Any]:
        params = super().request_params(prompt_len, seed)
        n = _OUT_LEN.get()
        params.update(max_tokens=n, min_tokens=n, ignore_eos=True)
        return params


class BenchLoop(AsyncRolloutLoop):
    """The real loop; only ``generate_one`` picks this request's prompt ids and length (no tokenizer)."""

    async def setup(self) -> None:
        self._taken: dict[int, int] = {}

    async def generate_one(self, prompt: list[dict[str, Any]], tools: list[Any], group_id: int = 0) -> Rollout:
        k = self._taken.get(group_id, 0)
        self._taken[group_id] = k + 1
        msg = prompt[0]
        token = _OUT_LEN.set(msg["out_lens"][k])
        self.channels.put_metric("bench/request_start_unix", time.time())  # the worker's send ramp (see _ramp)
        try:
            turn = await self.generate_one_turn(msg["ids"][k])
        finally:
            _OUT_LEN.reset(token)
        return Rollout(completion=[{"role": "assistant", "content": ""}], completion_ids=turn.output_ids, turns=[turn])


class _NoText:
    """The tokenizer the default loop decodes completions with: the bench has token ids only."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


class BenchGroupLoop(AsyncRolloutLoop):
    """The real loop with the default ``generate_one`` (a group is one request for G choices); only the prompt's
    rendering is the bench's: the group's token ids, and its output length for ``FixedLengthSampling``."""

    def render_prompt(self, prompt: list[dict[str, Any]]) -> list[int]:
        msg = prompt[0]
        _OUT_LEN.set(msg["out_lens"][0])  # this group's task context; its request's parameters read it
        return list(msg["ids"][0])


def last_token_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Trivial and cheap, but not constant (a constant reward would drop every group as zero-std)."""
    return [float(ids[-1] % 3) if ids else 0.0 for ids in completion_ids]


def run_worker(base_url: str, opts: argparse.Namespace, workloads: dict[str, list[Req]]) -> dict[str, Any]:
    """``--repeats`` worker runs per shape (a fresh worker and an empty prefix cache each time); the median one."""
    return {name: _median_row([_worker_run(base_url, opts, name, reqs) for _ in range(opts.repeats)])
            for name, reqs in workloads.items()}  # fmt: skip


def run_worker_group(base_url: str, opts: argparse.Namespace, workloads: dict[str, list[Req]]) -> dict[str, Any]:
    """As :func:`run_worker` with the default loop (one request per group), at the shapes whose groups share
    prompt and length."""
    return {name: _median_row([_worker_run(base_url, opts, name, reqs, group=True) for _ in range(opts.repeats)])
            for name, reqs in workloads.items() if name in GROUP_LENGTH_SHAPES}  # fmt: skip


async def _reset_cache(base_url: str) -> None:
    async with AsyncServerClient(base_url) as client:
        await client.reset_prefix_cache()


def _worker_run(base_url: str, opts: argparse.Namespace, name: str, reqs: list[Req], group: bool = False
                ) -> dict[str, Any]:  # fmt: skip
    from asyncgrpo.rollout.worker import RolloutWorker

    g = sum(1 for r in reqs if r.group == 0)
    rows = []
    for grp in sorted({r.group for r in reqs}):
        mine = [r for r in reqs if r.group == grp]
        rows.append({"prompt": [{"role": "user", "content": f"group {grp}", "ids": [r.prompt for r in mine],
                                 "out_lens": [r.out_len for r in mine]}]})  # fmt: skip
    settings = RolloutSettings(model_name=SERVED_NAME, sampling=_sampling(base_url, opts, FixedLengthSampling),
                               num_generations=g, max_staleness=1000, seed=0, max_concurrent_rollouts=len(reqs),
                               initial_tokens_per_step=10**12, num_epochs=1,
                               answer_parse_processes=opts.answer_parse_processes)  # fmt: skip
    if group:
        loop: AsyncRolloutLoop = BenchGroupLoop(settings, rows, [last_token_reward], _NoText())
    else:
        loop = BenchLoop(settings, rows, [last_token_reward], None)
    asyncio.run(_reset_cache(base_url))
    before = asyncio.run(_stages_once(base_url))
    worker = RolloutWorker(loop, heartbeat_timeout=max(_remaining(), 1.0))
    worker.start(timeout=_remaining())
    occ = Occupancy(lambda: _server_counts(base_url), interval_s=0.1).__enter__()  # /metrics: 10 a second at most
    t0, t0_unix = time.perf_counter(), time.time()
    metrics: list[tuple[str, float, float]] = []
    first_s, groups, trained_tokens = None, 0, 0
    try:
        while True:
            sample = worker.get_sample(timeout=_remaining())
            metrics += worker.drain_metrics()
            if sample.end:
                break
            groups += 1
            trained_tokens += sum(sum(s.loss_mask) for s in sample.sequences)
            if first_s is None:  # G3: until the first group is scored, groups start one at a time
                first_s = time.perf_counter() - t0
                at_first = asyncio.run(_stages_once(base_url))  # the engine's work on group 0 (alone)
        seconds, end_unix = time.perf_counter() - t0, time.time()
    finally:
        occ.__exit__()
        worker.stop()
    metrics += worker.drain_metrics()
    after = asyncio.run(_stages_once(base_url))
    tokens = int(after["gen_tokens"] - before["gen_tokens"])
    if groups != len(rows):
        raise RuntimeError(f"worker {name}: {groups}/{len(rows)} groups came back")
    stages = (
        _server_delta(before, after)
        | _worker_stages(metrics)
        | _ramp([v for n, v, _ in metrics if n == "bench/request_start_unix"], g, t0_unix)
        | {"tail_after_last_step_s": _tail_s(after, end_unix)}
        | _tail_split(after, end_unix)
    )
    stages |= occ.summary()
    row = _row(reqs, tokens, seconds, stages)
    first_group_tokens = sum(r.out_len for r in reqs if r.group == 0)  # the admission runs group 0 alone
    row["first_group_s"] = first_s
    row["steady_generated_tok_per_s"] = (tokens - first_group_tokens) / max(seconds - first_s, 1e-9)
    row["phases"] = {"first_group": _phase(_server_delta(before, at_first), first_s),
                     "after_first_group": _phase(_server_delta(at_first, after), seconds - first_s)}  # fmt: skip
    row["trained_tokens_queued"] = trained_tokens
    kv = opts.server_kv_cache_tokens
    row["initial_concurrency_cap"] = min(len(reqs), kv // opts.max_model_len) if kv else len(reqs)
    n = opts.answer_parse_processes
    row["answer_parse_processes"] = default_parse_processes() if n is None else n
    row["max_concurrency"] = max((v for n, v, _ in metrics if n == "rollout/concurrency"), default=0)
    return row


def _phase(stages: dict[str, float], seconds: float) -> dict[str, float]:
    """Decode steps, engine seconds and the engine's busy share of one phase of the worker run."""
    busy = stages.get("decode_s", 0.0) + stages.get("prefill_s", 0.0)
    return {"seconds": seconds, "decode_steps": stages.get("decode_steps", 0), "engine_s": busy,
            "engine_busy_frac": busy / max(seconds, 1e-9)}  # fmt: skip


async def _stages_once(base_url: str) -> dict[str, Any]:
    async with AsyncServerClient(base_url) as client:
        return await _server_stages(client)


def _worker_stages(metrics: list[tuple[str, float, float]]) -> dict[str, float]:
    """Per-group scoring and admission waits summed (wall seconds; groups overlap, so sums can pass the run's
    time), and the mean rollout latency (a rollout's request-to-answer time, not a stage of the run)."""
    wanted = ("rollout/score_s", "rollout/backpressure_s", "rollout/score_wait_s", "rollout/duration_s")
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for name, value, _ in metrics:
        if name in wanted:
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    out = {}
    for name, total in sums.items():
        short = name.split("/")[1]
        if name == "rollout/duration_s":
            out["worker_rollout_latency_s_mean"] = total / counts[name]
        else:
            out[f"worker_{short}_sum"] = total
            out[f"worker_{short}_mean"] = total / counts[name]
    return out


def _ramp(starts: list[float], group_size: int, started_unix: float | None = None) -> dict[str, float]:
    """How long the worker took to start its rollouts: the first group's (it runs alone, G3) and the rest's,
    first start to last. Requests the engine receives over a longer ramp finish over a longer tail.

    With ``started_unix`` (when ``start()`` returned) also how long the first request took to start: the first
    group's phase is this + the engine's work + scoring it and handing it over. A few milliseconds below zero at
    times: the child starts generating as soon as it reports ready, before ``start()`` has returned."""
    if not starts:
        return {}
    starts = sorted(starts)
    first, rest = starts[:group_size], starts[group_size:]
    out = {"worker_first_group_start_spread_s": first[-1] - first[0]}
    if rest:
        out["worker_rest_start_spread_s"] = rest[-1] - rest[0]
    if started_unix is not None:
        out["worker_first_request_after_start_s"] = starts[0] - started_unix
    return out


# ---------------------------------------------------------------------- main

_DEADLINE = [float("inf")]


def _remaining() -> float:
    left = _DEADLINE[0] - time.monotonic()
    if left <= 0:
        raise TimeoutError("the run passed --max-seconds")
    return left


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

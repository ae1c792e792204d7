"""The B5-HTTP variants behind the server (bench/rollout_path.py): every request over HTTP, and the real rollout worker."""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import sys
import time
from pathlib import Path
from typing import Any

from asyncgrpo.client.answer_parse import AnswerParsers, default_parse_processes
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.sampling import SamplingSettings
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.types import Rollout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.*

from bench.rollout_workload import (
    GROUP_LENGTH_SHAPES,
    SERVED_NAME,
    Occupancy,
    Req,
    _median_row,
    _remaining,
    _row,
    _server_counts,
    _timing_delta,
    _warmup,
)

logger = logging.getLogger("rollout_path")


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

"""The rollout worker's periodic look at the servers: throughput, retries, KV use, queue and preemptions (G5, M1).

Every few seconds the worker reads each server's ``/metrics`` (when they have them) and moves
the concurrency cap; the readings become ``rollout/*`` metrics (KV use: the fullest server;
running, queued and preempted requests: summed over servers). Counters are sent every poll,
0 included, so plots have no gaps.

With several servers (X5) each one also gets ``rollout/server/<i>/*`` figures (``<i>`` is its
place in ``vllm_server_base_url``): requests, errors, calls in flight, KV use, whether it is
still in use, and the weight version it reports on ``/weight_info``. A server that fails its
poll and ``/health`` is dropped from the pool here too, so an idle dead server is noticed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from asyncgrpo.client.pool import ServerPool
from asyncgrpo.errors import ServerError
from asyncgrpo.rollout.admission import METRICS_POLL_INTERVAL_S, ConcurrencyCap

logger = logging.getLogger(__name__)

FIRST_POLL_S = 1.0  # the first look at the server comes this soon; then every METRICS_POLL_INTERVAL_S
POLL_CALL_TIMEOUT_S = 10.0  # one /weight_info read of the poll; a slow server must not stall the others
_VERSION_NUMBER = re.compile(r"(\d+)$")  # "step-12" -> 12: the trainer labels versions with the step


def _version_number(info: Any) -> float | None:
    version = info.get("weight_version") if isinstance(info, dict) else None
    match = _VERSION_NUMBER.search(str(version)) if version is not None else None
    return float(match.group(1)) if match else None


async def _read(pool: ServerPool, i: int, has_metrics: bool) -> tuple[dict[str, float] | None, float | None]:
    """Server ``i``'s ``/metrics`` (None when it has none or fails) and its weight version (several servers)."""
    client = pool.clients[i]
    m = version = None
    try:
        if has_metrics:
            m = await client.metrics()
        if len(pool) > 1:
            info = await client.request("GET", "/weight_info", retries=0, timeout=POLL_CALL_TIMEOUT_S)
            version = _version_number(info)
    except (TimeoutError, ServerError, OSError) as e:
        if len(pool) > 1 and isinstance(e, ServerError) and e.status == 404:
            return m, None  # a server without /weight_info (real vLLM outside dev mode): no version figure
        logger.warning("could not read the /metrics of server %s: %s", client.base_url, e)
        if len(pool) > 1 and not await client.health():
            pool.mark_dead(i, f"no answer to its metrics poll: {e}")
    return m, version


async def poll_server_metrics(
    has_metrics: bool, pool: ServerPool, cap: ConcurrencyCap, channels: Any, generated_tokens: Callable[[], int]
) -> None:
    """Run until cancelled.

    Args:
        has_metrics: the servers serve Prometheus ``/metrics`` (probed at start).
        pool: the worker's servers (each client's ``retry_count`` is read and reset each poll).
        cap: the live concurrency cap, moved by the servers' KV use and queues.
        channels: the worker's channels (``put_metric``).
        generated_tokens: the worker's running count of generated tokens.
    """
    last_tokens, last_t = 0, time.perf_counter()
    last_preemptions: list[float | None] = [None] * len(pool)  # each server's running total at the previous poll
    interval = METRICS_POLL_INTERVAL_S if has_metrics else 1.0
    delay = min(FIRST_POLL_S, interval)  # a first reading soon, so even a run shorter than the interval has one
    several = len(pool) > 1
    while True:
        await asyncio.sleep(delay)
        delay = interval
        now = time.perf_counter()
        put = channels.put_metric
        tokens = generated_tokens()
        put("rollout/generated_tokens_per_s", (tokens - last_tokens) / max(now - last_t, 1e-9))
        last_tokens, last_t = tokens, now
        put("rollout/vllm_retry_count", float(sum(c.retry_count for c in pool.clients)))
        for c in pool.clients:
            c.retry_count = 0
        live = pool.alive()
        readings = await asyncio.gather(*(_read(pool, i, has_metrics) for i in live))
        if several:
            _put_per_server(pool, dict(zip(live, readings)), put)
        got = [(i, m) for i, (m, _) in zip(live, readings) if m is not None]
        if has_metrics and not got:
            continue
        if has_metrics:
            usage = max(m.get("vllm:kv_cache_usage_perc", 0.0) for _, m in got)
            waiting = sum(int(m.get("vllm:num_requests_waiting", 0)) for _, m in got)
            cap.on_metrics(usage, waiting)
            put("rollout/vllm_kv_cache_usage_frac", usage)
            put("rollout/vllm_running_requests", sum(m.get("vllm:num_requests_running", 0.0) for _, m in got))
            put("rollout/vllm_queued_requests", float(waiting))
            fresh = 0.0
            for i, m in got:
                pool.stats[i].kv_usage = m.get("vllm:kv_cache_usage_perc", 0.0)
                total = m.get("vllm:num_preemptions_total", m.get("vllm:num_preemptions", 0.0))
                last = last_preemptions[i]
                # A restarted server starts its total again from 0: count what it did since then.
                fresh += total - last if last is not None and total >= last else 0.0
                last_preemptions[i] = total
            put("rollout/vllm_preemption_count", fresh)
        put("rollout/concurrency_cap", float(cap.cap))


def _put_per_server(
    pool: ServerPool, readings: dict[int, tuple[dict[str, float] | None, float | None]], put: Callable[..., None]
) -> None:
    """``rollout/server/<i>/*`` for every server of the run (dead ones keep reporting ``alive`` = 0)."""
    for i, stats in enumerate(pool.stats):
        prefix = f"rollout/server/{i}/"
        put(prefix + "alive", 1.0 if stats.alive else 0.0)
        put(prefix + "request_count", float(stats.requests))
        put(prefix + "error_count", float(stats.errors))
        put(prefix + "outstanding", float(stats.outstanding))
        stats.requests = stats.errors = 0
        m, version = readings.get(i, (None, None))
        if m is not None:
            put(prefix + "kv_cache_usage_frac", m.get("vllm:kv_cache_usage_perc", 0.0))
        if version is not None:
            put(prefix + "weight_version", version)

"""The rollout worker's periodic look at the server: throughput, retries, KV use, queue and preemptions (G5, M1).

Every few seconds the worker reads the server's ``/metrics`` (when it has them) and moves
the concurrency cap; the readings become ``rollout/*`` metrics. Counters are sent every
poll, 0 included, so plots have no gaps.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from asyncgrpo.client.errors import ServerError
from asyncgrpo.rollout.admission import METRICS_POLL_INTERVAL_S, ConcurrencyCap

logger = logging.getLogger(__name__)

FIRST_POLL_S = 1.0  # the first look at the server comes this soon; then every METRICS_POLL_INTERVAL_S


async def poll_server_metrics(
    has_metrics: bool, client: Any, cap: ConcurrencyCap, channels: Any, generated_tokens: Callable[[], int]
) -> None:
    """Run until cancelled.

    Args:
        has_metrics: the server serves Prometheus ``/metrics`` (probed at start).
        client: the worker's ``AsyncServerClient`` (its ``retry_count`` is read and reset each poll).
        cap: the live concurrency cap, moved by the server's KV use and queue.
        channels: the worker's channels (``put_metric``).
        generated_tokens: the worker's running count of generated tokens.
    """
    last_tokens, last_t = 0, time.perf_counter()
    last_preemptions: float | None = None  # the server's running total at the previous poll
    interval = METRICS_POLL_INTERVAL_S if has_metrics else 1.0
    delay = min(FIRST_POLL_S, interval)  # a first reading soon, so even a run shorter than the interval has one
    while True:
        await asyncio.sleep(delay)
        delay = interval
        now = time.perf_counter()
        put = channels.put_metric
        tokens = generated_tokens()
        put("rollout/generated_tokens_per_s", (tokens - last_tokens) / max(now - last_t, 1e-9))
        last_tokens, last_t = tokens, now
        put("rollout/vllm_retry_count", float(client.retry_count))
        client.retry_count = 0
        if has_metrics:
            try:
                m = await client.metrics()
            except (TimeoutError, ServerError, OSError) as e:
                logger.warning("could not read the server's /metrics: %s", e)
                continue
            usage = m.get("vllm:kv_cache_usage_perc", 0.0)
            waiting = int(m.get("vllm:num_requests_waiting", 0))
            cap.on_metrics(usage, waiting)
            put("rollout/vllm_kv_cache_usage_frac", usage)
            put("rollout/vllm_running_requests", m.get("vllm:num_requests_running", 0.0))
            put("rollout/vllm_queued_requests", float(waiting))
            total = m.get("vllm:num_preemptions_total", m.get("vllm:num_preemptions", 0.0))
            # A restarted server starts its total again from 0: count what it did since then.
            fresh = total - last_preemptions if last_preemptions is not None and total >= last_preemptions else 0.0
            put("rollout/vllm_preemption_count", fresh)
            last_preemptions = total
        put("rollout/concurrency_cap", float(cap.cap))

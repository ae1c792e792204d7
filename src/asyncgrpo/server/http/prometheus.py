"""``GET /metrics``: the engine's live state under vLLM's Prometheus names.

A custom collector reads ``engine.stats()`` at scrape time into a private
registry (no global state, several servers per process are fine). Counters are
declared without the ``_total`` suffix because prometheus-client appends it:
``vllm:num_preemptions`` is exposed as ``vllm:num_preemptions_total``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from asyncgrpo.server.engine.request import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LABELS = ["model_name", "engine"]


class EngineCollector:
    """Yields the vllm:* families from one ``stats()`` call per scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, engine_index: str = "0") -> None:
        self._stats = stats
        self._labels = [model_name, engine_index]

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
        ]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(self._labels, float(value))
            yield family
        counters = [
            ("vllm:num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions_total),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total),
            ("vllm:generation_tokens", "Number of generation tokens processed.", s.generation_tokens_total),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.prefix_cache_queries_total,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                s.prefix_cache_hits_total,
            ),
            (
                "asyncgrpo:prefill_tokens_computed",
                "Prompt tokens whose K/V prefill steps computed (not cache hits).",
                s.prefill_tokens_computed_total,
            ),
        ]
        for name, doc, value in counters:  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(self._labels, float(value))
            yield family


def make_registry(stats: Callable[[], EngineStats], model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(stats, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)

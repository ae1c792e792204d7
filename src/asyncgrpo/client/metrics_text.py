"""Reading the Prometheus text exposition of ``GET /metrics`` with ``prometheus_client``'s own parser.

``parse_prometheus_text`` flattens the metric families into samples (exact sample names such as
``..._total``, labels unescaped, ``+Inf``/``NaN`` values, timestamps dropped); ``vllm_metrics`` reduces the
``vllm:*`` series of several engines to one number per name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# Gauges that are fractions: over several engines (data-parallel ranks) the fullest one counts (docs/metrics.md takes
# the maximum: one full engine preempts even when the others are empty), not their sum.
_MAXED = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass(frozen=True)
class Sample:
    """One sample line of the exposition."""

    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


_PARSE_ERRORS = (ValueError, TypeError, IndexError, KeyError)  # what the parser raises on malformed input


def _first_bad_line(text: str) -> str:
    """The parser's error does not always quote the line: find it by parsing sample lines one at a time."""
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                list(text_string_to_metric_families(line + "\n"))
            except _PARSE_ERRORS:
                return line
    return text


def parse_prometheus_text(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition, in order.

    Raises:
        ValueError: a line that does not follow the format (the message quotes the line).
    """
    try:
        families = list(text_string_to_metric_families(text))
    except _PARSE_ERRORS as exc:
        raise ValueError(f"malformed Prometheus metrics line {_first_bad_line(text)!r}: {exc}") from exc
    return [Sample(s.name, float(s.value), dict(s.labels)) for family in families for s in family.samples]


def vllm_metrics(text: str, model_name: str | None = None) -> dict[str, float]:
    """The ``vllm:*`` values of an exposition, one number per metric name.

    Series of the same name (one per engine / data-parallel rank) are summed, except
    the KV-cache usage fractions, which take the maximum. ``model_name`` keeps only the
    series with that ``model_name`` label.
    """
    grouped: dict[str, list[float]] = {}
    for s in parse_prometheus_text(text):
        if not s.name.startswith("vllm:"):
            continue
        if model_name is not None and s.labels.get("model_name", model_name) != model_name:
            continue
        grouped.setdefault(s.name, []).append(s.value)
    return {name: (max(values) if name in _MAXED else sum(values)) for name, values in grouped.items()}

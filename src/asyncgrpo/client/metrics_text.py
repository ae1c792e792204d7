"""A small parser for the Prometheus text exposition format (``GET /metrics``).

Only what the client needs: sample lines ``name{label="value",...} value [timestamp]``,
comments skipped, label values unescaped (``\\\\``, ``\\"``, ``\\n``), and the
special values ``+Inf``, ``-Inf`` and ``NaN``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Gauges that are fractions: over several engines (data-parallel ranks) the fullest one counts (the document takes
# the maximum: one full engine preempts even when the others are empty), not their sum.
_MAXED = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@dataclass(frozen=True)
class Sample:
    """One sample line of the exposition."""

    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


def _parse_value(text: str) -> float:
    special = {"+inf": math.inf, "inf": math.inf, "-inf": -math.inf, "nan": math.nan}
    low = text.lower()
    if low in special:
        return special[low]
    return float(text)


def _parse_labels(text: str, pos: int) -> tuple[dict[str, str], int]:
    """Parse ``{a="x",b="y"}`` starting at ``text[pos] == "{"``; return labels and the index after ``}``."""
    labels: dict[str, str] = {}
    i = pos + 1
    while True:
        while i < len(text) and text[i] in " ,":
            i += 1
        if i >= len(text):
            raise ValueError(f"unterminated label set in metrics line {text!r}")
        if text[i] == "}":
            return labels, i + 1
        eq = text.find("=", i)
        if eq == -1:
            raise ValueError(f"malformed label set in metrics line {text!r}")
        key = text[i:eq].strip()
        if eq + 1 >= len(text) or text[eq + 1] != '"':
            raise ValueError(f"label {key!r} has no quoted value in metrics line {text!r}")
        i = eq + 2
        chars: list[str] = []
        while True:
            if i >= len(text):
                raise ValueError(f"unterminated label value in metrics line {text!r}")
            c = text[i]
            if c == "\\" and i + 1 < len(text):
                nxt = text[i + 1]
                chars.append("\n" if nxt == "n" else nxt)
                i += 2
                continue
            if c == '"':
                i += 1
                break
            chars.append(c)
            i += 1
        labels[key] = "".join(chars)


def parse_prometheus_text(text: str) -> list[Sample]:
    """Parse every sample line of a Prometheus text exposition.

    Raises:
        ValueError: a sample line that does not follow the format (names the line).
    """
    samples: list[Sample] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            labels, end = _parse_labels(line, brace)
            rest = line[end:].split()
        else:
            name, *rest = line.split()
            labels = {}
        if not rest:
            raise ValueError(f"metrics line without a value: {raw!r}")
        try:
            value = _parse_value(rest[0])
        except ValueError as exc:
            raise ValueError(f"metrics line with a bad value: {raw!r}") from exc
        samples.append(Sample(name, value, labels))
    return samples


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

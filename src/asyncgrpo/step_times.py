"""Which steps were warm-up: the rule behind ``perf/warmup_share`` and the run doctor's warm-up verdict.

Its own module, importing nothing heavy: the command line's report parser (built for every ``asyncgrpo``
command, ``serve`` too) reads it, and ``serve`` must reach its engine's spawn without importing torch.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

SLOW_STEP_FACTOR = 2.0  # a step slower than twice the median step is warm-up (a compile, first kernels, a cold cache)


def slow_steps(durations: Sequence[float]) -> list[float]:
    """The step durations above ``SLOW_STEP_FACTOR`` x their median: the run's warm-up (``perf/warmup_share``)."""
    if not durations:
        return []
    limit = SLOW_STEP_FACTOR * statistics.median(durations)
    return [d for d in durations if d > limit]


def warmup_share(durations: Sequence[float]) -> float:
    """Share of the summed step ``durations`` spent in slow steps (0 without time)."""
    total = sum(durations)
    return sum(slow_steps(durations)) / total if total > 0 else 0.0

"""Dynamic sampling's accounting: how far the worker over-samples, and how many groups each kept one cost (issue 36).

Groups whose rewards all tie are dropped (R5) and a step fills with kept groups, so a step of ``B`` tokens needs
``B / keep`` generated tokens when a fraction ``keep`` of the generated tokens survives. Two pieces:

* ``expected_kept_share``: the staleness admission (G3, ``admission.py``) bounds the *trainable* tokens queued or
  in flight. Counting every in-flight group at its full size, a worker whose groups mostly tie holds back although
  most of that work will never reach the trainer; with dynamic sampling on, an in-flight group counts at its
  expected kept share (the kept fraction of the recent groups' tokens), floored at ``1 / max_factor``: the
  over-sampled work goes through the same admission and limit, and the cap bounds how far it runs ahead.
* ``OverSamplingCount``: per optimizer step, groups generated (scored) against groups kept; the ratio is the
  ``dynamic_sampling/generated_per_kept`` metric, and the first time a step passes the cap it yields the one line
  that says so (the step goes on filling; the worker's look-ahead stays at the cap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DYNAMIC_SAMPLING_METRICS: dict[str, str] = {
    "dynamic_sampling/generated_groups": "scored groups the step pulled from the worker (kept and dropped for ties)",
    "dynamic_sampling/kept_groups": "of those, groups with non-zero reward variance (trained now, or held for the next step)",
    "dynamic_sampling/generated_per_kept": "groups generated per kept group in the step (the over-sampling factor)",
    "dynamic_sampling/cap_hit": "1 when the step passed dynamic_sampling_max_factor, else 0",
}


def expected_kept_share(kept_tokens: int, generated_tokens: int, max_factor: float) -> float:
    """Fraction of an in-flight group's tokens the admission counts: the kept share so far, at least 1/max_factor.

    Before any token is generated nothing is known and the whole group counts (1.0); ``max_factor <= 1`` turns
    over-sampling off (1.0 always).
    """
    if max_factor <= 1 or generated_tokens <= 0:
        return 1.0
    return min(1.0, max(kept_tokens / generated_tokens, 1.0 / max_factor))


@dataclass
class OverSamplingCount:
    """Groups generated and kept in one optimizer step; ``close_step`` hands out its metrics and starts the next.

    Args:
        max_factor: the cap on generated groups per kept group (``dynamic_sampling_max_factor``).
    """

    max_factor: float
    generated: int = 0
    kept: int = 0
    cap_hit: bool = False

    def __post_init__(self) -> None:
        if self.max_factor < 1:
            raise ValueError(f"dynamic_sampling_max_factor must be >= 1, got {self.max_factor}")

    @property
    def factor(self) -> float:
        """Generated per kept group (inf: none kept yet; NaN: nothing generated)."""
        if self.generated == 0:
            return math.nan
        return self.generated / self.kept if self.kept else math.inf

    def on_group(self, kept: bool) -> str | None:
        """Count one scored group; returns the cap line the first time this step passes the cap, else None.

        The cap is passed when ``generated > max_factor × max(kept, 1)``: with none kept yet, a step may try
        ``max_factor`` groups before the line.
        """
        self.generated += 1
        self.kept += int(kept)
        if self.cap_hit or self.generated <= self.max_factor * max(self.kept, 1):
            return None
        self.cap_hit = True
        return (
            f"dynamic sampling: {self.generated} groups generated for {self.kept} kept, over the cap of "
            f"{self.max_factor:g} per kept group (dynamic_sampling_max_factor); the step keeps filling with kept "
            "groups, but most prompts score the same on every sample: prompt pools (prompt_pools=True), a "
            "dataset matched to the model, or a reward with partial credit give more signal"
        )

    def close_step(self) -> list[tuple[str, float]]:
        """The step's metrics, then zero counts for the next step."""
        factor = self.factor
        out = [
            ("dynamic_sampling/generated_groups", float(self.generated)),
            ("dynamic_sampling/kept_groups", float(self.kept)),
        ]
        if math.isfinite(factor):
            out.append(("dynamic_sampling/generated_per_kept", factor))
        out.append(("dynamic_sampling/cap_hit", float(self.cap_hit)))
        self.generated = self.kept = 0
        self.cap_hit = False
        return out

"""Dynamic sampling's accounting: how many groups each kept one cost, per optimizer step (issue 36).

Groups whose rewards all tie are dropped and a step fills with kept groups (R5): that is DAPO's dynamic sampling,
and the worker never stops producing while a step still needs samples. The groups generated to replace dropped
ones count whole against the same token-based staleness admission (G3): a dropped group frees its tokens when it
ends. (An admission that counted in-flight groups at their expected kept share, so as to over-sample ahead, was
measured on the demo and removed: its overshoot landed past ``max_staleness``, 70 samples dropped as stale in one
step against none, for no held-out gain; ``bench/results/dynamic_sampling_cpu.json``.)

``OverSamplingCount`` counts, per optimizer step, the scored groups the step pulled against those kept; the ratio
is the ``dynamic_sampling/generated_per_kept`` metric (logged in every run). With ``dynamic_sampling`` on, the first
time a step passes ``dynamic_sampling_max_factor`` it yields the one line that says so (the step goes on filling;
``ZERO_STD_PATIENCE_GROUPS`` tied groups in a row still stop the run with its diagnosis).
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

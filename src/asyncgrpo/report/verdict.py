"""``Verdict``, one matched row of a run-doctor table, and the number formats every table's figures use.

Its own module so that the tables can live in several files (``diagnose.py``, ``startup.py``) that all build it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Verdict:
    """One matched table row: ``table`` it comes from, the row's diagnosis, what to do, and its figures."""

    table: str
    diagnosis: str
    action: str
    healthy: bool
    figures: dict[str, str] = field(default_factory=dict)

    def text(self) -> str:
        figs = ", ".join(f"{k} = {v}" for k, v in self.figures.items())
        mark = "ok" if self.healthy else "!!"
        return f"[{mark}] {self.table}: {self.diagnosis}. {self.action} ({figs})"


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def pct(x: float) -> str:
    return f"{100 * x:.0f} %"


def g3(x: float) -> str:
    return f"{x:.3g}"

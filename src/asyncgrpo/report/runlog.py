"""A run's logged metrics as numeric series, plus the few settings the diagnosis tables compare against.

``metrics.jsonl`` holds one JSON object per logging window (``step``, ``time`` and the window's metrics);
the last line of a finished run is transformers' summary (``train_runtime`` ...), which is not a window.
``run_config.json`` (written by ``asyncgrpo train``) holds the ``AsyncGRPOConfig`` the run used.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asyncgrpo.errors import UserError

METRICS_FILE = "metrics.jsonl"
RUN_CONFIG_FILE = "run_config.json"


@dataclass(frozen=True)
class RunSettings:
    """The run's settings the diagnosis reads (defaults are AsyncGRPOConfig's)."""

    max_concurrent_rollouts: int = 512
    max_staleness: int = 4
    num_generations: int = 8
    reward_range: tuple[float, float] | None = None  # None: [min(0, lowest seen), max(1, highest seen)]
    router_replay: bool = False
    mixture_of_experts: bool = False  # run_config.json's "mixture_of_experts" (the doctor also reads moe/* metrics)


@dataclass
class RunLog:
    """Logging windows of one run, oldest first. ``series(name)`` gives (steps, values) without NaNs."""

    windows: list[dict[str, float]]
    settings: RunSettings = field(default_factory=RunSettings)

    def series(self, name: str, last: int | None = None) -> tuple[list[float], list[float]]:
        rows = self.windows if last is None else self.recent(last)
        pairs = [(r["step"], r[name]) for r in rows if _finite(r.get(name))]
        return [p[0] for p in pairs], [float(p[1]) for p in pairs]

    def recent(self, last_steps: int) -> list[dict[str, float]]:
        """Windows whose step lies within the last ``last_steps`` optimizer steps."""
        if not self.windows:
            return []
        final = self.windows[-1]["step"]
        return [r for r in self.windows if r["step"] > final - last_steps]

    def has(self, name: str) -> bool:
        return any(_finite(r.get(name)) for r in self.windows)

    def names(self) -> list[str]:
        """Every metric name logged with a finite value, sorted."""
        return sorted({k for r in self.windows for k, v in r.items() if k != "step" and _finite(v)})

    @property
    def last_step(self) -> int:
        return int(self.windows[-1]["step"]) if self.windows else 0


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_windows(path: Path) -> list[dict[str, float]]:
    """The logging windows of a ``metrics.jsonl`` (summary lines and non-numeric values left out)."""
    windows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n} is not JSON ({e}); is this a metrics.jsonl written by asyncgrpo?") from e
        if not isinstance(record, dict) or "step" not in record or "train_runtime" in record:
            continue
        windows.append({k: float(v) for k, v in record.items() if _finite(v)})
    windows.sort(key=lambda r: r["step"])
    return windows


def load_run(run_dir: str | Path, **overrides: Any) -> RunLog:
    """Read ``RUN_DIR/metrics.jsonl`` (or a metrics file itself) and the run's settings.

    Args:
        run_dir: the run's ``output_dir`` or its ``metrics.jsonl``.
        **overrides: RunSettings fields given explicitly (None values are ignored).

    Raises:
        ValueError: no metrics file, or one without logging windows.
    """
    path = Path(run_dir)
    metrics = path if path.is_file() else path / METRICS_FILE
    if not metrics.is_file():
        raise UserError(f"{metrics} not found: pass the run's output_dir (the folder holding {METRICS_FILE})")
    windows = read_windows(metrics)
    if not windows:
        raise UserError(f"{metrics} holds no logging window yet: wait for the first logged step")
    values: dict[str, Any] = {}
    cfg_file = metrics.parent / RUN_CONFIG_FILE
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        args = cfg.get("args", cfg)
        for name in ("max_concurrent_rollouts", "max_staleness", "num_generations"):
            if isinstance(args.get(name), int):
                values[name] = args[name]
        values["router_replay"] = bool(args.get("router_replay", False))
        values["mixture_of_experts"] = bool(cfg.get("mixture_of_experts", False))
    values.update({k: v for k, v in overrides.items() if v is not None})
    if "reward_range" in values:
        values["reward_range"] = tuple(float(x) for x in values["reward_range"])
    return RunLog(windows, RunSettings(**values))

"""The run doctor (X2): ``asyncgrpo report RUN_DIR`` draws a run's curves and applies the diagnosis tables.

asyncgrpo report outputs/demo            # -> outputs/demo/report/report.html + PNGs, verdicts printed
asyncgrpo report outputs/demo --last 20  # judge the last 20 steps only
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from asyncgrpo.errors import UserError
from asyncgrpo.report.diagnose import Verdict, diagnose
from asyncgrpo.report.page import write_html
from asyncgrpo.report.plots import PANELS, draw_panels
from asyncgrpo.report.runlog import RunLog, RunSettings, load_run

__all__ = [
    "PANELS",
    "RunLog",
    "RunSettings",
    "Verdict",
    "add_report_arguments",
    "diagnose",
    "load_run",
    "run_report",
    "write_report",
]

logger = logging.getLogger(__name__)


def write_report(run: RunLog, out_dir: Path, last: int = 50, title: str = "asyncgrpo run report") -> list[Verdict]:
    """Write ``out_dir/report.html`` and one PNG per curve; returns the verdicts."""
    verdicts = diagnose(run, last)
    panels = draw_panels(run, out_dir)
    s = run.settings
    note = (
        f"{len(run.windows)} logging windows up to step {run.last_step}; verdicts over the last {last} steps. "
        f"Settings compared against: max_concurrent_rollouts={s.max_concurrent_rollouts}, "
        f"max_staleness={s.max_staleness}, num_generations={s.num_generations}."
    )
    write_html(out_dir / "report.html", title, verdicts, panels, note)
    return verdicts


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the run's output_dir (holding metrics.jsonl), or a metrics.jsonl")
    parser.add_argument("--out", default=None, help="where report.html and the PNGs go (default: RUN_DIR/report)")
    parser.add_argument("--last", type=int, default=50, help="judge the windows of the last N steps (default: 50)")
    parser.add_argument(
        "--max-concurrent-rollouts",
        type=int,
        default=None,
        help="the run's value (default: from RUN_DIR/run_config.json, else 512)",
    )
    parser.add_argument(
        "--max-staleness", type=int, default=None, help="the run's value (default: from run_config.json, else 4)"
    )
    parser.add_argument(
        "--num-generations", type=int, default=None, help="the run's value (default: from run_config.json, else 8)"
    )
    parser.add_argument(
        "--reward-range",
        type=float,
        nargs=2,
        default=None,
        metavar=("LOW", "HIGH"),
        help="the reward's range (default: [min(0, lowest), max(1, highest)] seen)",
    )


def run_report(ns: argparse.Namespace) -> int:
    if ns.last < 1:
        raise UserError(f"--last {ns.last}: must be >= 1 step")
    run = load_run(
        ns.run_dir,
        max_concurrent_rollouts=ns.max_concurrent_rollouts,
        max_staleness=ns.max_staleness,
        num_generations=ns.num_generations,
        reward_range=ns.reward_range,
    )
    src = Path(ns.run_dir)
    out = Path(ns.out) if ns.out else (src.parent if src.is_file() else src) / "report"
    verdicts = write_report(run, out, ns.last)
    lines = [f"asyncgrpo report: {len(run.windows)} windows up to step {run.last_step}"]
    lines += [v.text() for v in verdicts] or ["not enough metrics for any diagnosis table"]
    lines.append(f"wrote {out / 'report.html'} and {len(list(out.glob('*.png')))} plots")
    print("\n".join(lines), flush=True)
    return 0

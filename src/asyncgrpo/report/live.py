"""What ``asyncgrpo train`` / ``demo`` print while a run goes: one short line per logging window, the
doctor's verdicts every few windows, and a closing summary (first -> last reward, steps, wall time, model)."""

from __future__ import annotations

import logging
import time
from typing import Any

from transformers.trainer_callback import ProgressCallback

from asyncgrpo.report.diagnose import diagnose
from asyncgrpo.report.runlog import RunLog, RunSettings
from asyncgrpo.step_times import SLOW_STEP_FACTOR

logger = logging.getLogger(__name__)

SHOWN = (
    ("reward", "reward"),
    ("reward_kept", "kept"),
    ("frac_reward_zero_std", "zero-std"),
    ("completions/mean_length", "len"),
    ("eval/reward", "eval"),
    ("perf/step_s", "step s"),
    ("perf/rollout_wait_s", "wait s"),
    ("perf/weight_sync_s", "sync s"),
)


def missing_reward_note(logs: dict[str, float]) -> str | None:
    """Why a window's line has no reward or no kept column (issue 44 item 6), from the reward events it holds.

    Reward metrics are events of the groups scored during the window (``rollout/advantages.py``): every scored
    group gives ``frac_reward_zero_std``, one with a scorable completion ``reward``, a trained one ``reward_kept``.
    """

    def has(key: str) -> bool:
        return isinstance(logs.get(key), int | float) and logs[key] == logs[key]  # present and not NaN

    if not has("frac_reward_zero_std"):
        return "no group finished scoring during this step: it trained groups scored before"
    if not has("reward"):
        return "no completion of the groups scored during this step could be scored"
    if not has("reward_kept"):
        return "every group scored during this step was dropped: equal rewards within each group, no signal"
    return None


def compact_line(step: int, max_steps: int, logs: dict[str, float]) -> str:
    """``step   3/8  reward 0.5  kept 0.6 ...``; a note in parentheses says why a reward column is missing."""
    parts = [f"{label} {logs[key]:.3g}" for key, label in SHOWN if isinstance(logs.get(key), (int, float))]
    note = missing_reward_note(logs)
    return f"step {step:>3}/{max_steps}  " + "  ".join(parts) + (f"  ({note})" if note else "")


class CompactProgress(ProgressCallback):
    """The progress bar (with ETA), one short line per logged window instead of the whole metrics dict, and the
    run doctor's verdicts every ``doctor_every`` windows (0: never).

    It also keeps the windows it saw, for the end-of-run summary.
    """

    def __init__(self, doctor_every: int = 0, settings: RunSettings | None = None) -> None:
        super().__init__()
        self.doctor_every = doctor_every
        self.settings = settings or RunSettings()
        self.windows: list[dict[str, float]] = []
        self.t0 = time.time()

    def _write(self, text: str) -> None:
        if self.training_bar is not None:
            self.training_bar.write(text)
        else:
            print(text, flush=True)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        if any(k.startswith("eval/") for k in logs) and "reward" not in logs:
            self._write(
                f"eval at step {state.global_step}: "
                + "  ".join(f"{k} {v:.3g}" for k, v in logs.items() if k.startswith("eval/"))
            )
        else:
            self._write(compact_line(state.global_step, state.max_steps, logs))
        self.windows.append(
            {"step": float(state.global_step), **{k: v for k, v in logs.items() if isinstance(v, (int, float))}}
        )
        n = len(self.windows)
        if self.doctor_every and n % self.doctor_every == 0:
            for v in diagnose(RunLog(self.windows, self.settings), last=50):
                self._write("  doctor " + v.text())


def install_compact_progress(trainer: Any, progress: ProgressCallback) -> None:
    """Replace the trainer's progress printer (transformers' bar, or its dict printer under ``disable_tqdm``)."""
    from transformers.trainer_callback import PrinterCallback

    for cls in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(cls)
    trainer.add_callback(progress)


def settings_of(args: Any) -> RunSettings:
    """The settings the doctor's verdicts compare against, from an ``AsyncGRPOConfig``."""
    return RunSettings(args.max_concurrent_rollouts, args.max_staleness, args.num_generations,
                       router_replay=bool(getattr(args, "router_replay", False)))  # fmt: skip


def summary(windows: list[dict[str, float]], steps: int, wall_s: float, model_dir: str | None) -> str:
    """``reward 0.12 -> 0.55 over 20 steps in 312 s; model saved to out/``: the trend in one line, then the
    start-up figures (``startup_line``) when the run logged them."""
    rewards = [w["reward"] for w in windows if isinstance(w.get("reward"), float | int) and w["reward"] == w["reward"]]
    trend = (
        f"reward {rewards[0]:.3g} -> {rewards[-1]:.3g} (first -> last logging window)"
        if rewards
        else "no reward logged"
    )
    evals = [w["eval/reward"] for w in windows if "eval/reward" in w]
    if evals:
        trend += f", eval/reward {evals[0]:.3g} -> {evals[-1]:.3g}"
    where = f"; model and tokenizer saved to {model_dir}" if model_dir else ""
    startup = startup_line(windows)
    return f"done: {trend}, {steps} steps in {wall_s:.0f} s{where}" + (f"\n{startup}" if startup else "")


def startup_line(windows: list[dict[str, float]]) -> str | None:
    """``start-up: first step 41 s after launch, server ready in 38 s; warm-up 64 % of training time; 2 recompiles
    after step 1``: the figures this run logged (perf/time_to_first_step_s ...), None without any."""

    def last(name: str) -> float | None:
        values = [w[name] for w in windows if isinstance(w.get(name), float | int) and w[name] == w[name]]
        return values[-1] if values else None

    first, ready, share, recompiles = (last(f"perf/{n}") for n in
                                       ("time_to_first_step_s", "server_ready_s", "warmup_share", "recompiles"))  # fmt: skip
    parts = []
    if first is not None:
        parts.append(f"first step {first:.1f} s after launch")
    if ready is not None:
        parts.append(f"server ready in {ready:.1f} s")
    figures = [", ".join(parts)] if parts else []
    if share is not None:
        figures.append(
            f"warm-up {100 * share:.0f} % of training time (steps slower than {SLOW_STEP_FACTOR:g}x the median)"
        )
    if recompiles is not None:
        figures.append(f"{recompiles:.0f} recompile{'' if recompiles == 1 else 's'} after step 1")
    return "start-up: " + "; ".join(figures) if figures else None

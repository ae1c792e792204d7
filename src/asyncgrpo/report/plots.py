"""The curves a user reads to judge a run, one PNG each (matplotlib, no display needed)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from asyncgrpo.report.runlog import RunLog


@dataclass(frozen=True)
class Panel:
    """One figure: its file stem, title, y label and the metrics drawn on it; ``pattern`` adds every logged metric
    whose name it matches (names that depend on the run: eval sets, pools)."""

    name: str
    title: str
    ylabel: str
    metrics: tuple[str, ...]
    pattern: str = ""

    def lines(self, run: RunLog) -> list[str]:
        """The panel's metrics the run logged: the fixed ones, then those matching ``pattern``."""
        found = [m for m in self.metrics if run.has(m)]
        if self.pattern:
            found += [m for m in run.names() if re.search(self.pattern, m) and m not in found]
        return found


PANELS: tuple[Panel, ...] = (
    Panel("reward", "Reward: all groups, trained, dropped", "reward", ("reward", "reward_kept", "reward_dropped")),
    Panel("eval", "Held-out reward (eval_dataset, each eval set)", "reward", ("eval/reward",), r"^eval/[^/]+/reward$"),
    Panel("eval_k", "Held-out pass@k and maj@k", "fraction", (), r"^eval/([^/]+/)?(pass|maj)@\d+$"),
    Panel("pools", "Prompt pools over steps", "prompts", ("pools/retired", "pools/parked"), r"^pools/[^/]+/size$"),
    Panel("pool_pass_rate", "Prompt pools: mean running pass rate", "pass rate", (), r"^pools/[^/]+/pass_rate$"),
    Panel(
        "dynamic_sampling",
        "Dynamic sampling: groups generated per kept group",
        "groups",
        ("dynamic_sampling/generated_per_kept", "dynamic_sampling/cap_hit"),
    ),
    Panel("zero_std", "Groups without signal (dropped)", "fraction", ("frac_reward_zero_std",)),
    Panel("staleness", "Sample staleness", "weight updates", ("sample/staleness_mean", "sample/staleness_max")),
    Panel(
        "wait",
        "Rollout wait against step time",
        "seconds",
        ("perf/step_s", "perf/rollout_wait_s", "rollout/backpressure_s"),
    ),
    Panel("throughput", "Generated tokens per second", "tokens/s", ("rollout/generated_tokens_per_s",)),
    Panel("concurrency", "Concurrency against cap", "rollouts", ("rollout/concurrency", "rollout/concurrency_cap")),
    Panel("queue", "Rollout queue", "samples", ("rollout/queue_size", "batch/samples_per_step")),
    Panel("kv_cache", "Server KV-cache use", "fraction", ("rollout/vllm_kv_cache_usage_frac",)),
    Panel(
        "importance",
        "Importance ratio and masked fraction",
        "ratio / fraction",
        (
            "sampling/importance_sampling_ratio/min",
            "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max",
            "sampling/masked_mean",
        ),
    ),
    Panel("entropy", "Entropy", "nats", ("entropy",)),
    Panel("length", "Completion length", "tokens", ("completions/mean_length", "completions/max_length")),
    Panel(
        "duplicates",
        "Duplicate and clipped completions",
        "fraction",
        ("completions/duplicate_frac", "completions/clipped_ratio"),
    ),
)


def draw_panels(run: RunLog, out_dir: Path) -> list[tuple[Panel, Path]]:
    """Write one PNG per panel with data to ``out_dir``; returns the panels drawn and their files."""
    import matplotlib

    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = []
    for panel in PANELS:
        lines = [(m, *run.series(m)) for m in panel.lines(run)]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        for metric, steps, values in lines:
            ax.plot(steps, values, marker="." if len(steps) < 40 else None, label=metric)
        if panel.name == "concurrency":
            limit = run.settings.max_concurrent_rollouts
            ax.axhline(limit, color="grey", linestyle="--", label=f"max_concurrent_rollouts = {limit}")
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"{panel.name}.png"
        fig.savefig(path)
        plt.close(fig)
        drawn.append((panel, path))
    return drawn

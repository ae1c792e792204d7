"""The README's main job: a short async GRPO run of SmolLM2-135M-Instruct on a reasoning-gym task.

    asyncgrpo demo [--max-steps 12] [--device auto]

It fetches the offline demo model, starts the embedded generation server as a
child process, spawns the rollout worker and trains with ``AsyncGRPOTrainer``,
printing the reward of every step. ``examples/demo.yaml`` is the same run as a
config file for ``asyncgrpo train --config``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from typing import Any

from rich.console import Console
from transformers.trainer_callback import ProgressCallback

logger = logging.getLogger(__name__)

DEMO_CONFIG: dict[str, Any] = {
    "model": "demo",
    "dataset": {
        "recipe": "reasoning_gym", "task": "chain_sum", "size": 256, "seed": 0,
        "min_terms": 2, "max_terms": 2, "max_digits": 1,
    },
    "reward_funcs": [
        "asyncgrpo.recipes.tasks:numeric_answer_reward",
        "asyncgrpo.recipes.tasks:format_reward",
    ],
    "server": {
        "embedded": True, "device": "auto",
        "args": ["--max-model-len", "512", "--kv-cache-tokens", "32768", "--max-num-seqs", "64"],
    },
    "args": {
        "output_dir": "outputs/demo", "max_steps": 12, "num_generations": 4, "max_completion_length": 48,
        "token_budget": 512, "learning_rate": 5e-6, "max_staleness": 2, "gradient_checkpointing": False,
        "save_strategy": "no", "report_to": [], "logging_steps": 1, "seed": 0,
    },
}  # fmt: skip

_SHOWN = (("reward", "reward"), ("reward_kept", "kept"), ("frac_reward_zero_std", "zero-std"),
          ("completions/mean_length", "len"), ("perf/step_s", "step s"), ("perf/rollout_wait_s", "wait s"),
          ("perf/weight_sync_s", "sync s"))  # fmt: skip


class CompactProgress(ProgressCallback):
    """The progress bar (with ETA), plus one short line per logged step instead of the whole metrics dict."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if not state.is_world_process_zero or not logs or "train_runtime" in logs:
            return
        parts = [f"{label} {logs[key]:.3g}" for key, label in _SHOWN if key in logs]
        line = f"step {state.global_step:>3}/{state.max_steps}  " + "  ".join(parts)
        if self.training_bar is not None:
            self.training_bar.write(line)
        else:
            print(line, flush=True)


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-steps", type=int, default=DEMO_CONFIG["args"]["max_steps"], help="optimizer steps")
    parser.add_argument("--device", default="auto", help="device of the embedded server (auto|cpu|cuda)")
    parser.add_argument("--output-dir", default=DEMO_CONFIG["args"]["output_dir"], help="checkpoints and metrics")


def run_demo(ns: argparse.Namespace) -> int:
    from asyncgrpo.launch import train_from_config

    cfg = copy.deepcopy(DEMO_CONFIG)
    cfg["args"].update(max_steps=ns.max_steps, output_dir=ns.output_dir)
    cfg["server"]["device"] = ns.device
    console = Console()
    console.print(
        f"[bold]asyncgrpo demo[/bold]: SmolLM2-135M-Instruct learns 1-digit sums (reasoning-gym chain_sum), "
        f"{ns.max_steps} async GRPO steps on the embedded server. Metrics: {ns.output_dir}/metrics.jsonl"
    )
    t0 = time.time()
    out = train_from_config(cfg, callbacks=[CompactProgress()], replace_progress=True)
    console.print(f"done: {out.global_step} steps in {time.time() - t0:.0f}s, train loss {out.training_loss:.4f}")
    return 0

"""The README's main job: a short async GRPO run of SmolLM2-135M-Instruct on a reasoning-gym task.

    asyncgrpo demo [--max-steps 12] [--device auto]

It fetches the offline demo model, starts the embedded generation server as a
child process, spawns the rollout worker and trains with ``AsyncGRPOTrainer``,
printing the reward of every step, and saves the final model to ``--output-dir``.
``examples/demo.yaml`` is the same run as a config file for ``asyncgrpo train --config``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from typing import Any

from rich.console import Console

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


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-steps", type=int, default=DEMO_CONFIG["args"]["max_steps"], help="optimizer steps")
    parser.add_argument("--device", default="auto", help="device of the embedded server (auto|cpu|cuda)")
    parser.add_argument("--output-dir", default=DEMO_CONFIG["args"]["output_dir"], help="checkpoints and metrics")


def run_demo(ns: argparse.Namespace) -> int:
    from asyncgrpo.launch import run_summary, train_from_config
    from asyncgrpo.report.live import CompactProgress

    cfg = copy.deepcopy(DEMO_CONFIG)
    cfg["args"].update(max_steps=ns.max_steps, output_dir=ns.output_dir)
    cfg["server"]["device"] = ns.device
    console = Console()
    console.print(
        f"[bold]asyncgrpo demo[/bold]: SmolLM2-135M-Instruct learns 1-digit sums (reasoning-gym chain_sum), "
        f"{ns.max_steps} async GRPO steps on the embedded server. Metrics: {ns.output_dir}/metrics.jsonl"
    )
    t0 = time.time()
    out = train_from_config(cfg, progress=CompactProgress())
    console.print(run_summary(ns.output_dir, out.global_step, t0))
    return 0

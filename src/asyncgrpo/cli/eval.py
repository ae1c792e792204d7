"""``asyncgrpo eval --model DIR --config run.yaml``: a saved model scored on the YAML's held-out sets.

    asyncgrpo eval --model outputs/demo --config examples/eval_sets.yaml [--eval_temperature 0.7] [--eval_num_generations 4]

The sets are the YAML's ``eval_datasets`` (named, each with its own ``num_samples``, ``temperature`` and
``reward_funcs``; an agent set also its ``environment_factory``, ``tools`` and ``max_tool_calling_iterations``,
whose episodes run through the default ``AsyncRolloutLoop``'s tool loop) or its one ``eval_dataset``. Each prints a progress bar while it runs and then one table:
mean@k, pass@k (the unbiased estimator) and maj@k for k = 1, 2, 4, ... up to its samples. The YAML's ``server``
section decides where generation runs (``embedded: true`` starts a server on DIR), and ``AsyncGRPOConfig`` flags
override the file as with ``asyncgrpo train``.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from asyncgrpo.files import local_only
from asyncgrpo.tasks.eval_sets import EvalSet, evaluate_sets, set_settings
from asyncgrpo.tasks.evaluate import EvalSettings, settings_from_config


def format_table(name: str, scores: dict[str, float], s: EvalSettings, seconds: float) -> str:
    """One set's figures: a header line, then one row per k (mean@k, pass@k, maj@k where answers compare)."""
    prefix = f"eval/{name}/"
    mine = {k.removeprefix(prefix): v for k, v in scores.items() if k.startswith(prefix)}
    ks = sorted({int(key.split("@")[1]) for key in mine if "@" in key})
    mode = "greedy" if s.temperature == 0 else f"temperature {s.temperature:g}"
    head = (
        f"{name}: {int(mine['num_prompts'])} prompts x {s.num_samples} samples ({mode}) in {seconds:.1f}s; "
        f"reward {mine['reward']:.4f}, mean length {mine['completions/mean_length']:.1f}, "
        f"clipped {mine['completions/clipped_ratio']:.2f}"
    )
    lines = [head]
    if "tools/call_frequency" in mine:  # an agent set: its episodes went through the tool loop
        lines.append(
            f"  per episode: {_fmt(mine['tools/call_frequency'])} tool calls, {_fmt(mine['rollout/turns_mean'])} "
            f"turns; failed calls {_fmt(mine['tools/failure_frequency'])}, stopped at the turn limit "
            f"{_fmt(mine['tools/loop_exhausted_frac'])}"
        )
    cols = [c for c in ("mean", "pass", "maj") if f"{c}@1" in mine]
    lines.append("  " + f"{'k':>4}" + "".join(f"{c + '@k':>10}" for c in cols))
    for k in ks:
        cells = "".join(f"{_fmt(mine[f'{c}@{k}']):>10}" for c in cols)
        lines.append("  " + f"{k:>4}" + cells)
    return "\n".join(lines)


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.4f}"


# The AsyncGRPOConfig fields `asyncgrpo eval` reads (settings_from_config, the tokenizer, the server address): its
# --help lists these; every other field still parses (a training YAML is accepted as is) and changes nothing here.
EVAL_HELP_SECTIONS: dict[str, tuple[str, ...]] = {
    "what is scored": (
        "eval_temperature", "eval_num_generations", "max_completion_length", "top_k", "chat_template_kwargs", "seed",
        "pass_threshold", "max_tool_calling_iterations",
    ),
    "generation server": ("vllm_server_base_url", "vllm_server_timeout", "max_concurrent_rollouts"),
    "model": ("trust_remote_code",),
}  # fmt: skip
EVAL_REST_NOTE = (
    "every other AsyncGRPOConfig field of `asyncgrpo train --help` is accepted (a training YAML works as is) and "
    "does not change the score"
)


def run_eval(argv: list[str]) -> int:
    """``asyncgrpo eval --model DIR --config run.yaml``: every held-out set of the YAML scored on ``DIR``'s weights."""
    import contextlib

    from tqdm import tqdm
    from transformers import AutoTokenizer

    from asyncgrpo.cli.launch import build_eval, parse_train, resolve_model
    from asyncgrpo.cli.run_server import start_embedded, wait_for_server
    from asyncgrpo.errors import UserError

    description = (
        "Score a model on the YAML's eval_datasets (or eval_dataset) with their reward functions; AsyncGRPOConfig "
        "flags (--eval_temperature, --eval_num_generations, --max_completion_length) set what a set leaves out."
    )

    def add_model(parser: Any) -> None:
        parser.add_argument("--model", required=True, help="the checkpoint directory (or hub id) to score")

    spec, ns = parse_train(argv, "asyncgrpo eval", description, add_model, (EVAL_HELP_SECTIONS, EVAL_REST_NOTE))
    held_out = build_eval(spec)
    if held_out is None:
        raise UserError(
            f"{ns.config} has no eval_datasets (or eval_dataset): add one, e.g. "
            "eval_datasets: {sums: {recipe: reasoning_gym, task: chain_sum, size: 32, seed: 1, num_samples: 4}}"
        )
    sets = held_out if isinstance(held_out, dict) else {"eval": EvalSet(held_out)}
    model = resolve_model(ns.model)
    with contextlib.ExitStack() as stack:
        if spec.server.get("embedded"):
            base_url = start_embedded(stack, model, spec.server)
        else:
            base_url = spec.args.server_urls[0]  # evaluation uses the first server
            wait_for_server(base_url, float(spec.server.get("wait_s", 60)))
        tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=spec.args.trust_remote_code,
                                                  **local_only(model))  # fmt: skip
        base = settings_from_config(spec.args, base_url)
        for name, s in sets.items():
            t0 = time.perf_counter()
            with tqdm(total=len(s.dataset), desc=name, unit="prompt", file=sys.stderr, leave=False) as bar:
                scores = evaluate_sets(tokenizer, {name: s}, spec.reward_funcs, base, "eval", lambda *_: bar.update)
            print(format_table(name, scores, set_settings(base, s), time.perf_counter() - t0), flush=True)
    return 0

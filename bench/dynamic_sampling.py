"""Dynamic sampling on against off on the demo: held-out gain per generated sample, one seed each.

    python bench/dynamic_sampling.py --seed 0 --out bench/results/dynamic_sampling_cpu.json [--jobs 2]

Each variant is one ``asyncgrpo train --config examples/demo.yaml`` (the demo's run) in its own process, with
``--dynamic_sampling true`` (the default: tied groups take no room, steps fill with groups that have a signal,
up to ``dynamic_sampling_max_factor`` groups per kept one) or ``false`` (a tied group keeps its room in its step:
no over-sampling, smaller steps), timed from the command's start to its exit. Generated samples are the groups
the trainer's steps pulled (``dynamic_sampling/generated_groups``, logged in every run) times ``num_generations``:
kept and dropped ones, not the few the worker had in flight when the run ended. Trained samples are the
``batch/samples_per_step`` summed. The held-out gain is the last ``eval/reward`` minus the first (100 held-out
problems, greedy, before the first step and after the last). ``--jobs N`` runs N variants at once (a many-core
host); on a shared 2-core machine keep 1 (the default): the runs then take ~4 min each and are started under
``nice``.

An earlier result (commit 946d042) measured an admission that counted in-flight groups at their expected kept
share: it dropped 70 samples as stale for no held-out gain, and was removed. Until issue 36's fix the switch only
added a line, so both variants ran the same algorithm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import current_commit, write_result

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"on": ["--dynamic_sampling", "true"], "off": ["--dynamic_sampling", "false"]}


def one_run(name: str, seed: int, work: Path, max_steps: int | None) -> dict[str, float | str]:
    out = work / f"{name}-seed{seed}"
    cmd = ["nice", sys.executable, "-m", "asyncgrpo", "train", "--config", str(REPO / "examples" / "demo.yaml"),
           "--seed", str(seed), "--output_dir", str(out), *VARIANTS[name]]  # fmt: skip
    if max_steps is not None:
        cmd += ["--max_steps", str(max_steps), "--eval_steps", str(max_steps)]
    t0 = time.time()
    subprocess.run(cmd, check=True)
    wall = time.time() - t0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    if len(evals) < 2:
        raise RuntimeError(
            f"{out}/metrics.jsonl holds {len(evals)} held-out evaluations; expected one before and after"
        )
    G = yaml.safe_load((REPO / "examples" / "demo.yaml").read_text())["args"]["num_generations"]
    groups = sum(r.get("dynamic_sampling/generated_groups", 0.0) for r in rows)
    kept = sum(r.get("dynamic_sampling/kept_groups", 0.0) for r in rows)
    trained = sum(r.get("batch/samples_per_step", 0.0) for r in rows)
    steps = sum("dynamic_sampling/generated_groups" in r for r in rows)
    cap_hits = sum(r.get("dynamic_sampling/cap_hit", 0.0) for r in rows)
    gain = evals[-1] - evals[0]
    return {
        "variant": name, "seed": seed, "before": evals[0], "after": evals[-1], "gain": gain,
        "steps": steps, "generated_samples": groups * G, "trained_samples": trained, "kept_groups": kept,
        "cap_hits": cap_hits, "generated_per_kept": groups / kept if kept else None,
        "gain_per_1k_generated_samples": 1000 * gain / (groups * G) if groups else None, "wall_s": wall,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--max-steps", type=int, default=None, help="default: the demo's")
    p.add_argument("--jobs", type=int, default=1, help="variants run at once (1 on a shared 2-core machine)")
    p.add_argument("--work", default="outputs/bench_dynamic_sampling", help="where each run's folder goes")
    p.add_argument("--out", default="bench/results/dynamic_sampling_cpu.json")
    p.add_argument("--keep", default=None, help="a former result file: its runs of the variants not run now are "
                   "kept (each run names the commit it ran on)")  # fmt: skip
    a = p.parse_args()
    with ThreadPoolExecutor(max(a.jobs, 1)) as pool:
        runs = list(pool.map(lambda v: one_run(v, a.seed, Path(a.work), a.max_steps), a.variants))
    for r in runs:
        r["commit"] = current_commit()
    if a.keep:
        former = json.loads(Path(a.keep).read_text())
        kept = [{"commit": former["commit"], **r} for r in former["runs"] if r["variant"] not in a.variants]
        runs = kept + runs
    for r in runs:
        per_k = r["gain_per_1k_generated_samples"]
        print(f"{r['variant']:>16}: {r['before']:.2f} -> {r['after']:.2f} ({r['gain']:+.2f}) from "
              f"{r['generated_samples']:.0f} generated samples ({r['generated_per_kept']:.2f} groups per kept one), "
              f"{r['trained_samples']:.0f} trained; "
              f"gain per 1k generated samples {per_k:+.3f}; {r['wall_s']:.0f} s")  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    note = (
        "one seed each: the demo's gain varies by seed (3 seeds: +0.40 / +0.34 / +0.32, bench/LOG.md), so a "
        "difference smaller than that spread is not a finding"
    )
    write_result(Path(a.out), {"runs": runs, "jobs": a.jobs, "note": note}, indent=1)


if __name__ == "__main__":
    main()

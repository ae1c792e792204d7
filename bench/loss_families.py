"""Does every loss type learn? The demo (``asyncgrpo demo``'s settings) once per ``loss_type``: held-out before/after.

    python bench/loss_families.py --out bench/results/loss_families_cpu.json [--jobs 1] [--seed 0]
    python bench/loss_families.py --loss-types grpo gspo --jobs 2

Each loss type is one run of the demo's config (``cli/demo.py``'s ``DEMO_CONFIG``: SmolLM2-135M-Instruct, 1-digit
sums, 8 steps at 3e-5, held-out accuracy on 100 problems before the first step and after the last) with the loss
fields below changed, in its own process (``nice -n 5``, ``OMP_NUM_THREADS=2``), timed from its start to its exit.
``--jobs`` runs several at once on a many-core host; on a shared 2-core machine keep 1 (the default). Every
finished run is written to the JSON at once, so an interrupted bench keeps what ran; runs of loss types not named
this time are kept from the file (``--loss-types asyncgrpo`` adds the reference objective to it).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result

# The loss fields of each run; everything else is the demo's. GSPO is TRL's recipe (paper section 5.1's epsilons)
# with the trust region against the sampler (no correction: with it, a sample trained once has ratio 1).
LOSS_TYPES: dict[str, dict[str, Any]] = {
    "asyncgrpo": {},
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4,
             "vllm_importance_sampling_correction": False},
    "cispo": {"loss_type": "cispo"},
}  # fmt: skip
DEFAULT_TYPES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo"]


def run_one(name: str, seed: int, output_dir: str) -> int:
    """One demo run with ``LOSS_TYPES[name]`` (this process: the child the driver starts)."""
    import copy

    from asyncgrpo.cli.demo import DEMO_CONFIG
    from asyncgrpo.cli.launch import train_from_config

    cfg = copy.deepcopy(DEMO_CONFIG)
    cfg["args"].update(output_dir=output_dir, seed=seed, **LOSS_TYPES[name])
    cfg["server"]["device"] = "cpu"
    train_from_config(cfg)
    return 0


def launch(name: str, seed: int, work: Path, timeout_s: float) -> dict[str, Any]:
    """Start ``run_one`` in a child process and read its held-out accuracies from metrics.jsonl."""
    out = work / f"loss-{name}-seed{seed}"
    cmd = ["nice", "-n", "5", sys.executable, __file__, "--one", name, "--seed", str(seed), "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, timeout=timeout_s, check=False)
    wall = time.time() - t0
    metrics = out / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    evals = [r for r in rows if "eval/reward" in r and r.get("time", 0) >= t0]
    result: dict[str, Any] = {"loss_type": name, "fields": LOSS_TYPES[name], "seed": seed, "wall_s": round(wall, 1),
                              "exit_code": proc.returncode, "steps": max((r.get("step", 0) for r in rows), default=0)}  # fmt: skip
    if len(evals) >= 2:
        result.update(before=evals[0]["eval/reward"], after=evals[-1]["eval/reward"])
        result["gain"] = result["after"] - result["before"]
    train = [r for r in rows if "loss" in r and "eval/reward" not in r]
    for key in ("sampling/masked_mean", "sampling/truncated_mean", "clip_ratio/region_mean", "policy_ratio/max"):
        vals = [r[key] for r in train if key in r]
        if vals:
            result[f"mean {key}"] = sum(vals) / len(vals)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loss-types", nargs="+", default=DEFAULT_TYPES, choices=sorted(LOSS_TYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each with OMP_NUM_THREADS=2)")
    p.add_argument("--work", default="outputs", help="where each run's folder goes")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    p.add_argument("--out", default="bench/results/loss_families_cpu.json")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--output-dir", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        sys.exit(run_one(a.one, a.seed, a.output_dir))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done: list[dict[str, Any]] = []
    if out.exists():  # keep the file's runs of other loss types (a bench run in parts)
        kept = [r for r in json.loads(out.read_text()).get("runs", []) if r["loss_type"] not in a.loss_types]
        done.extend(kept)
    order = [*dict.fromkeys([*DEFAULT_TYPES, *LOSS_TYPES])]

    def record(result: dict[str, Any]) -> None:
        done.append(result)
        gain = (
            f"{result['before']:.2f} -> {result['after']:.2f} ({result['gain']:+.2f})"
            if "gain" in result
            else "no eval"
        )
        print(f"{result['loss_type']}: {gain} in {result['wall_s']:.0f} s (exit {result['exit_code']})", flush=True)
        runs = sorted(done, key=lambda r: order.index(r["loss_type"]))
        write_result(out, {"seed": a.seed, "jobs": a.jobs, "runs": runs}, indent=1)

    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        futures = [pool.submit(launch, name, a.seed, Path(a.work), a.timeout_s) for name in a.loss_types]
        for f in futures:
            record(f.result())


if __name__ == "__main__":
    main()

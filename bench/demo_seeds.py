"""Does the demo learn beyond noise? ``asyncgrpo demo`` over several seeds: held-out accuracy before and after.

    python bench/demo_seeds.py --seeds 0 1 2 --out bench/results/demo_seeds.json

Each seed is one ``asyncgrpo demo --seed S`` in its own process (as a user runs it), timed from the command's start
to its exit. The seed changes sampling and the order of the training prompts; the 100 held-out problems are the
same for every seed. Prints each seed's accuracies and wall time, then the mean gain and its spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result


def one_seed(seed: int, max_steps: int | None, work: Path) -> dict[str, float]:
    out = work / f"demo-seed{seed}"
    cmd = [sys.executable, "-m", "asyncgrpo", "demo", "--seed", str(seed), "--output-dir", str(out)]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    t0 = time.time()
    subprocess.run(cmd, check=True)
    wall = time.time() - t0
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval/reward" in r]
    if len(evals) < 2:
        raise RuntimeError(
            f"{out}/metrics.jsonl holds {len(evals)} held-out evaluations; expected one before and after"
        )
    return {"seed": seed, "before": evals[0]["eval/reward"], "after": evals[-1]["eval/reward"], "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--max-steps", type=int, default=None, help="default: the demo's")
    p.add_argument("--work", default="outputs", help="where each seed's run folder goes")
    p.add_argument("--out", default="bench/results/demo_seeds.json")
    a = p.parse_args()
    runs = [one_seed(s, a.max_steps, Path(a.work)) for s in a.seeds]
    gains = [r["after"] - r["before"] for r in runs]
    summary = {
        "runs": runs,
        "gain_mean": statistics.mean(gains),
        "gain_min": min(gains),
        "gain_max": max(gains),
        "gain_stdev": statistics.stdev(gains) if len(gains) > 1 else 0.0,
        "wall_s_max": max(r["wall_s"] for r in runs),
    }
    for r in runs:
        print(f"seed {r['seed']}: {r['before']:.2f} -> {r['after']:.2f} ({r['after'] - r['before']:+.2f}) "
              f"in {r['wall_s']:.0f} s")  # fmt: skip
    print(f"gain {summary['gain_mean']:+.3f} (min {summary['gain_min']:+.2f}, max {summary['gain_max']:+.2f}, "
          f"stdev {summary['gain_stdev']:.3f}); slowest run {summary['wall_s_max']:.0f} s")  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(a.out), summary, indent=1)


if __name__ == "__main__":
    main()

"""MoE routing replay on CPU: the same short GRPO run on a tiny MoE with replay off and on.

    nice python bench/moe_replay.py --out bench/results/moe_replay_cpu.json [--steps 8] [--arch olmoe]

The server samples in bf16 (``asyncgrpo serve --dtype bfloat16 --enable-return-routed-experts``), the trainer
learns in fp32, so the two route some tokens differently, as a GPU server's kernels and a trainer's do. Both runs
fetch the routing (``vllm_return_routed_experts=True``) so both log ``moe/router_disagreement`` (the trainer router's
own top-k set vs the sampler's) and ``moe/routing_mismatch`` (the experts its forward used; 0 under replay). Task:
a reward for even token ids (``parity``), which a random-init model learns in a few steps. Model: the tiny
OLMoE- or Qwen3-MoE-shaped checkpoint of ``tests/helpers/moe_models.py`` (many experts, large expert outputs).
Same seed, same prompts, same initial weights for both runs; each run has its own server. ``max_staleness=0``:
every sample comes from the weights being trained, so the sampler/trainer gap is the bf16/fp32 one alone (with
stale samples the weights' change dominates it, and replay cannot undo that).

Reported per mode: the reward, ``sampling/sampling_logp_difference/mean`` and the moe metrics per step, and their
means. What replay must show: ``moe/routing_mismatch`` 0 and a smaller sampler/trainer log-prob gap.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file, tests.helpers
from bench.result_file import write_result

CURVES = ("reward", "sampling/sampling_logp_difference/mean", "moe/routing_mismatch/mean", "moe/routing_mismatch/max",
          "moe/router_disagreement/mean", "moe/router_disagreement/max")  # fmt: skip


def parity_reward(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def one_run(mode: str, model_dir: Path, steps: int, work: Path) -> dict:
    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
    from tests.helpers.servers import start_cpu_server

    server = start_cpu_server(model_dir, "--max-model-len", "256", "--kv-cache-tokens", "16384", "--dtype", "bfloat16",
                              "--enable-return-routed-experts", "--seed", "0")  # fmt: skip
    out = work / mode
    t0 = time.time()
    try:
        args = AsyncGRPOConfig(
            output_dir=str(out), max_steps=steps, num_generations=8, max_completion_length=16, token_budget=1024,
            vllm_server_base_url=server.base_url, report_to=[], save_strategy="no", learning_rate=5e-3,
            gradient_checkpointing=False, vllm_server_timeout=120, rollout_worker_timeout=120, seed=0,
            logging_steps=1, max_staleness=0, router_replay=mode == "replay", vllm_return_routed_experts=True,
        )  # fmt: skip
        dataset = reasoning_gym_dataset("chain_sum", size=64, seed=0, system_prompt=None)
        AsyncGRPOTrainer(str(model_dir), reward_funcs=[parity_reward], args=args, train_dataset=dataset).train()
    finally:
        server.stop()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r and "train_runtime" not in r]
    curves = {name: [r.get(name) for r in rows] for name in CURVES}
    means = {name: statistics.mean(v for v in values if v is not None) for name, values in curves.items()}
    return {"steps": [r["step"] for r in rows], "curves": curves, "means": means, "wall_s": time.time() - t0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--arch", default="olmoe", choices=["olmoe", "qwen3_moe"])
    p.add_argument("--out", default="bench/results/moe_replay_cpu.json")
    a = p.parse_args()
    from tests.helpers.moe_models import EXPERT_SCALE, SHAPES, sharp_moe_dir

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = sharp_moe_dir(a.arch, work / "model")
        runs = {mode: one_run(mode, model_dir, a.steps, work) for mode in ("disabled", "replay")}
    for mode, run in runs.items():
        m = run["means"]
        print(f"{mode:8s} reward {run['curves']['reward'][0]:.3f} -> {run['curves']['reward'][-1]:.3f}, "
              f"mean |dlogp| {m['sampling/sampling_logp_difference/mean']:.2e}, routing mismatch "
              f"{m['moe/routing_mismatch/mean']:.3f}, router disagreement {m['moe/router_disagreement/mean']:.3f} "
              f"({run['wall_s']:.0f} s)")  # fmt: skip
    experts, top_k = SHAPES[a.arch]
    result = {
        "setup": {"arch": a.arch, "experts": experts, "top_k": top_k, "expert_output_scale": EXPERT_SCALE,
                  "server_dtype": "bfloat16", "trainer_dtype": "float32", "steps": a.steps, "task": "parity"},
        "runs": runs,
    }  # fmt: skip
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(a.out), result, indent=1)


if __name__ == "__main__":
    main()

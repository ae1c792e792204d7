"""Async GRPO on two GPUs: embedded server on GPU 0, trainer on GPU 1, NCCL weight sync (issue 3 acceptance).

    python bench/two_gpu_run.py --data prompts.jsonl --steps 24 --out bench/results/two_gpu_run_h200x2.json

``--data`` is a JSONL file of rows ``{"prompt": [messages], "answer": "..."}`` (make one with
``python bench/two_gpu_run.py --make-data FILE`` where reasoning-gym is installed). The model is the offline
demo model (SmolLM2-135M-Instruct; set ASYNCGRPO_DEMO_GGUF on machines without a package index). The script
writes the run's metrics.jsonl beside the JSON summary (step time, weight sync, rollout wait, reward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result


def make_data(path: str, size: int, seed: int) -> None:
    from asyncgrpo.tasks.reasoning import reasoning_gym_dataset

    ds = reasoning_gym_dataset("chain_sum", size=size, seed=seed, min_terms=2, max_terms=2, max_digits=2)
    with open(path, "w") as fh:
        fh.writelines(json.dumps({"prompt": row["prompt"], "answer": row["answer"]}) + "\n" for row in ds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data")
    p.add_argument("--make-data")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", default="bench/results/two_gpu_run_h200x2.json")
    p.add_argument("--server-gpu", default="0")
    p.add_argument("--trainer-gpu", default="1")
    a = p.parse_args()
    if a.make_data:
        make_data(a.make_data, 512, 0)
        return 0
    # The trainer sees only its GPU; the server child gets the other one.
    os.environ["CUDA_VISIBLE_DEVICES"] = a.trainer_gpu
    import torch

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.assets import demo_model_dir
    from asyncgrpo.server.launcher import launch_server
    from asyncgrpo.tasks.reasoning import format_reward, numeric_answer_reward

    if not torch.cuda.is_available():
        print("needs CUDA (two GPUs): nothing measured", file=sys.stderr)
        return 2
    rows = [json.loads(line) for line in Path(a.data).read_text().splitlines() if line.strip()]
    model = demo_model_dir()
    out_dir = Path(a.out).with_suffix("")
    server_log = str(out_dir) + "-server.log"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    with launch_server(
        model, extra_args=["--device", "cuda", "--dtype", "float32", "--max-model-len", "1024"],
        env={"CUDA_VISIBLE_DEVICES": a.server_gpu}, log_path=server_log, timeout=600,
    ) as server:  # fmt: skip
        args = AsyncGRPOConfig(
            output_dir=str(out_dir),
            max_steps=a.steps,
            num_generations=8,
            max_completion_length=256,
            token_budget=8192,
            learning_rate=2e-6,
            vllm_server_base_url=server.base_url,
            report_to=[],
            save_strategy="no",
            gradient_checkpointing=False,
            max_staleness=4,
            logging_steps=1,
            seed=0,
        )
        trainer = AsyncGRPOTrainer(
            str(model), reward_funcs=[numeric_answer_reward, format_reward], args=args, train_dataset=rows
        )
        trainer.train()
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "perf/step_s" in m]

    def series(name: str) -> list[float]:
        return [m[name] for m in steps if name in m]

    summary = {
        "what": "async GRPO, SmolLM2-135M-Instruct, server cuda:0 (fp32), trainer cuda:1 (bf16 autocast), NCCL sync",
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "steps": len(steps),
        "wall_s": time.time() - t_start,
        "step_s_median": statistics.median(series("perf/step_s")),
        "weight_sync_s_median": statistics.median(series("perf/weight_sync_s")),
        "weight_sync_transfer_s_median": statistics.median(series("perf/weight_sync_transfer_s")),
        "rollout_wait_s_median": statistics.median(series("perf/rollout_wait_s")),
        "reward_first5": statistics.mean(series("reward")[:5]),
        "reward_last5": statistics.mean(series("reward")[-5:]),
        "reward_by_step": series("reward"),
        "config": {
            k: getattr(args, k)
            for k in ("num_generations", "max_completion_length", "token_budget", "learning_rate", "max_staleness")
        },
    }
    write_result(Path(a.out), summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "reward_by_step"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

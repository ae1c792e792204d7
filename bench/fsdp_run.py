"""Async GRPO with FSDP2 on two trainer ranks, the embedded server sharing GPU 0; the same run on one rank (issue 12).

    python bench/fsdp_run.py --steps 30 --out bench/results/fsdp_run_h200x2.json            # demo model
    python bench/fsdp_run.py --model synthetic --steps 30 --out /tmp/fsdp_run.json        # random-init 135M shape

Starts ``asyncgrpo serve`` on GPU 0 (``--gpu-memory-utilization`` 0.25, so a trainer rank fits beside it);
then, for 2 ranks and for 1 rank, launches the trainer as users do, with ``CUDA_VISIBLE_DEVICES=1,0`` (one
rank: ``1``); each run first pushes its initial weights, so both start from the same served weights::

    torchrun --standalone --nproc-per-node 2 bench/fsdp_run.py --rank-spec SPEC.json   # or --launcher accelerate

with FSDP2 set through ``AsyncGRPOConfig(fsdp="full_shard", fsdp_config={"fsdp_version": 2, ...})``. Every rank
records its peak GPU memory; rank 0 writes the run's step times, loss and reward curves. The combined JSON
compares the two runs (step time, tokens per second). ``--model demo`` is SmolLM2-135M-Instruct (offline: set
ASYNCGRPO_DEMO_GGUF) on ``bench/data/basic_arithmetic_train.jsonl`` (or ``--data``: JSONL rows ``{"prompt",
"answer"}``), rewarded by ``numeric_answer_reward`` + ``format_reward`` as in ``bench/learning.py``;
``--model synthetic`` is a random-init Llama of SmolLM2-135M's shape with a token-parity reward.

Trainer rank 0 sits on GPU 1 and rank 1 on GPU 0 beside the server: rank 0 is the weight sender, and NCCL
refuses a communicator with two members on one GPU, so the sender must not share the server's GPU.
``--device cpu`` runs the same plumbing on the CPU (tiny model, gloo) as a smoke test of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result

REPO = Path(__file__).resolve().parents[1]
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "tie_word_embeddings": True, "max_position_embeddings": 8192}  # fmt: skip
FSDP2 = {"fsdp": "full_shard",
         "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                         "state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": True}}  # fmt: skip
ACCELERATE_FSDP2 = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: {nproc}
mixed_precision: bf16
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_reshard_after_forward: true
"""


def arithmetic_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Two-term sums the demo model gets right some of the time (reward variance within a group)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        content = f"What is {a} + {b}? Think briefly, then give the final answer as <answer>NUMBER</answer>."
        rows.append({"prompt": [{"role": "user", "content": content}], "answer": str(a + b)})
    return rows


# ---------------------------------------------------------------- one trainer rank (under torchrun/accelerate)


def run_rank(spec_path: str) -> None:
    import torch

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines() if line.strip()]
    if spec["device"] == "cpu":
        from tests.helpers.fsdp_launch import allow_fsdp_on_cpu

        allow_fsdp_on_cpu()
    if spec["model"] == "synthetic":
        from tests.helpers.rewards import even_token_reward

        rewards: list[Any] = [even_token_reward]
    else:
        from asyncgrpo.tasks.reasoning import format_reward, numeric_answer_reward

        rewards = [numeric_answer_reward, format_reward]
    fsdp = FSDP2 if spec["launcher"] == "torchrun" else {}  # accelerate launch: the config file says FSDP2
    args = AsyncGRPOConfig(vllm_server_base_url=spec["base_url"], **spec["config"], **fsdp)
    trainer = AsyncGRPOTrainer(spec["model_dir"], reward_funcs=rewards, args=args, train_dataset=rows)
    from transformers import TrainerCallback

    class PushInitialWeights(TrainerCallback):
        """Sync once when training begins (every rank: the gathers are collective)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 0:
                trainer.sync_weights()

    # First in line at train begin, before the worker starts: the server may still hold an earlier run's weights.
    trainer.callback_handler.callbacks.insert(0, PushInitialWeights())
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    mine = {
        "rank": args.process_index,
        "device": str(args.device),
        "physical_gpu": os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[args.local_process_index]
        if cuda
        else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
    }
    ranks = [mine]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, mine)
    if trainer.is_world_process_zero():
        head = trainer.model.get_output_embeddings().weight
        summary = {"world_size": args.world_size, "fsdp2": type(head).__name__ == "DTensor", "train_wall_s": wall,
                   "per_rank": ranks, "accelerate": trainer.accelerator.distributed_type.value}  # fmt: skip
        Path(spec["summary"]).write_text(json.dumps(summary))


# ---------------------------------------------------------------- the orchestrating process


def _launch_cmd(launcher: str, nproc: int, spec_path: Path, workdir: Path) -> list[str]:
    script = [str(Path(__file__).resolve()), "--rank-spec", str(spec_path)]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    cfg = workdir / "accelerate_fsdp2.yaml"
    cfg.write_text(ACCELERATE_FSDP2.format(nproc=nproc))
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), *script]


def _series(metrics: list[dict[str, Any]], name: str) -> list[float]:
    return [m[name] for m in metrics if name in m]


def run_once(a: argparse.Namespace, nproc: int, model_dir: Path, data: Path, workdir: Path, url: str) -> dict[str, Any]:
    gpus = ",".join(a.trainer_gpus.split(",")[:nproc])
    out = workdir / f"ranks{nproc}"
    cpu = a.device == "cpu"
    config = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=str(out), max_steps=a.steps, num_generations=8, max_completion_length=a.max_completion_length,
        token_budget=a.token_budget, learning_rate=a.learning_rate, report_to=[], save_strategy="no",
        logging_steps=1, seed=0, max_staleness=4, gradient_checkpointing=True, vllm_server_timeout=300,
        use_cpu=cpu,
    )  # fmt: skip
    t0 = time.time()
    spec = {"model": a.model, "model_dir": str(model_dir), "data": str(data), "base_url": url,
            "config": config, "nproc": nproc, "launcher": a.launcher, "device": a.device,
            "summary": str(workdir / f"summary{nproc}.json")}  # fmt: skip
    spec_path = workdir / f"spec{nproc}.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "" if cpu else gpus,
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    cmd = _launch_cmd(a.launcher, nproc, spec_path, workdir)
    print(f"[fsdp_run] {nproc} rank(s): CUDA_VISIBLE_DEVICES={gpus} {' '.join(cmd)}", flush=True)
    with open(workdir / f"trainer{nproc}.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False, cwd=REPO).returncode
    if rc != 0:
        tail = (workdir / f"trainer{nproc}.log").read_text()[-5000:]
        raise RuntimeError(f"the {nproc}-rank trainer exited {rc}; log tail:\n{tail}")
    summary = json.loads(Path(spec["summary"]).read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "perf/step_s" in m]
    step_s = _series(steps, "perf/step_s")
    tokens = _series(steps, "batch/forwarded_tokens_per_step")
    steady = step_s[3:] or step_s  # the first steps include compilation and the first rollouts
    return {
        **summary,
        "command": " ".join(cmd),
        "cuda_visible_devices": gpus,
        "steps": len(steps),
        "wall_s": time.time() - t0,
        "step_s_median": statistics.median(steady),
        "step_s_mean": statistics.mean(steady),
        "fwd_bwd_s_median": statistics.median(_series(steps, "perf/fwd_bwd_s")[3:] or [0.0]),
        "forwarded_tokens_per_step_median": statistics.median(tokens) if tokens else None,
        "forwarded_tokens_per_s": sum(tokens[3:]) / max(sum(steady), 1e-9) if tokens else None,
        "weight_sync_s_median": statistics.median(_series(steps, "perf/weight_sync_s") or [0.0]),
        "rollout_wait_s_median": statistics.median(_series(steps, "perf/rollout_wait_s") or [0.0]),
        "loss_by_step": _series(steps, "loss"),
        "reward_by_step": _series(steps, "reward"),
        "step_s_by_step": step_s,
        "grad_norm_by_step": _series(steps, "grad_norm"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank-spec", help=argparse.SUPPRESS)  # set by the launcher for each trainer rank
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", default="bench/results/fsdp_run_h200x2.json")
    p.add_argument("--model", choices=("demo", "synthetic"), default="demo")
    p.add_argument(
        "--data",
        default=str(REPO / "bench" / "data" / "basic_arithmetic_train.jsonl"),
        help="JSONL rows {prompt, answer}; made here (two-term sums) when the file is missing",
    )
    p.add_argument("--launcher", choices=("torchrun", "accelerate"), default="torchrun")
    p.add_argument("--ranks", default="2,1", help="trainer rank counts to run, in order")
    p.add_argument("--server-gpu", default="0")
    p.add_argument("--trainer-gpus", default="1,0", help="physical GPUs of trainer ranks 0, 1, ... (rank 0 sends)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test of this script")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=2e-6)
    a = p.parse_args()
    if a.rank_spec:
        run_rank(a.rank_spec)
        return 0
    import torch

    if a.device == "cuda" and torch.cuda.device_count() < 2:
        print("needs two CUDA devices: nothing measured", file=sys.stderr)
        return 2
    workdir = Path(a.out).with_suffix("")
    workdir.mkdir(parents=True, exist_ok=True)
    if a.model == "demo":
        from asyncgrpo.assets import demo_model_dir

        model_dir = demo_model_dir()
    else:
        from asyncgrpo.assets import tiny_model_dir

        model_dir = tiny_model_dir("llama", **(SMOLLM2_135M if a.device == "cuda" else {}))
    data = Path(a.data)
    if not data.is_file():
        data = workdir / "prompts.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows(1024, 0)))
    from asyncgrpo.server.launcher import launch_server

    t0 = time.time()
    cpu = a.device == "cpu"
    flags = ["--device", a.device, "--dtype", "float32", "--max-model-len", "1024"]
    if not cpu:
        flags += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)]
    runs: dict[str, Any] = {}
    with launch_server(model_dir, extra_args=flags, env={"CUDA_VISIBLE_DEVICES": "" if cpu else a.server_gpu},
                       log_path=str(workdir / "server.log"), timeout=600) as server:  # fmt: skip
        server_start_s = time.time() - t0
        print(f"[fsdp_run] server up in {server_start_s:.0f}s at {server.base_url}", flush=True)
        for n in (int(x) for x in a.ranks.split(",")):
            try:
                runs[f"{n}_rank"] = run_once(a, n, model_dir, data, workdir, server.base_url)
            except Exception as exc:  # noqa: BLE001 - the other run's figures are still worth writing
                print(f"[fsdp_run] {n}-rank run failed: {exc}", file=sys.stderr, flush=True)
                runs[f"{n}_rank"] = {"error": str(exc)[-3000:]}
    result: dict[str, Any] = {
        "what": f"async GRPO, {a.model} SmolLM2-135M shape, FSDP2 trainer ranks on GPUs {a.trainer_gpus}, server on "
        f"GPU {a.server_gpu} at --gpu-memory-utilization {a.gpu_memory_utilization}, launched with {a.launcher}",
        "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "total_wall_s": time.time() - t0,
        "server_start_s": server_start_s,
        "runs": runs,
    }
    if all("step_s_median" in runs.get(k, {}) for k in ("2_rank", "1_rank")):
        two, one = runs["2_rank"], runs["1_rank"]
        result["two_over_one_step_time"] = two["step_s_median"] / one["step_s_median"]
        if two["forwarded_tokens_per_s"] and one["forwarded_tokens_per_s"]:
            result["two_over_one_tokens_per_s"] = two["forwarded_tokens_per_s"] / one["forwarded_tokens_per_s"]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    write_result(Path(a.out), result)
    short = {k: v for k, v in result.items() if k != "runs"}
    short["runs"] = {k: {x: y for x, y in r.items() if not x.endswith("_by_step")} for k, r in runs.items()}
    print(json.dumps(short, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

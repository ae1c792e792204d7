"""B6 and B8: asynchronous against synchronous GRPO on two GPUs, and held-out accuracy against wall-clock.

    python bench/learning.py --out bench/results/learning_h200x2.json [--train-seconds 180]
    python bench/learning.py --make-data bench/data     # where reasoning-gym is installed (CPU machine)

The same run twice, one after the other, each in its own process: the embedded server (bf16) on GPU 0, the
trainer on GPU 1, NCCL weight sync.
- ``async``: as shipped (``max_staleness=2``).
- ``sync``: ``sync_rollouts=True`` (the worker starts groups only while the trainer waits for samples, so
  generation and training never overlap) with ``max_staleness=1`` (the few groups still in flight when a step
  starts training are trained one update behind rather than thrown away).

Task: reasoning-gym ``basic_arithmetic`` (two one-digit terms, + and -), SmolLM2-135M-Instruct. Held-out problems
are generated with another seed and any question that also appears in the training set is removed. Held-out
accuracy is greedy decoding on the server, scored by ``numeric_answer_reward``, every ``--eval-every`` seconds of
training. The training clock excludes the evaluations (the worker of the async run keeps generating during an
evaluation, bounded by its staleness window; the note in the JSON says so).

Reported per mode: optimizer steps per minute, ``perf/rollout_wait_s`` as a share of the training clock, the
accuracy curve, the gain over the base model; and the ratios B6 (async steps/min over sync) and B8 (sync's
training time over the time async needed to reach sync's final accuracy).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result

TASKS = {  # reasoning-gym task -> its settings (chain_sum: the demo's task)
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]},
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},  # held-out questions need 2 digits
}
DATA_DIR = Path(__file__).parent / "data"
MODES = {
    "async": {"max_staleness": 2},
    "sync": {"max_staleness": 1, "sync_rollouts": True},
}


def make_data(out: Path, task: str, train_size: int = 1024, heldout_size: int = 200) -> None:
    """Train and held-out JSONL (``{"prompt": messages, "answer": str}``); held-out questions never trained on."""
    from asyncgrpo.tasks.reasoning import reasoning_gym_dataset

    out.mkdir(parents=True, exist_ok=True)
    train = reasoning_gym_dataset(task, size=train_size, seed=0, **TASKS[task])
    seen = {p[-1]["content"] for p in train["prompt"]}
    held = reasoning_gym_dataset(task, size=heldout_size * 20, seed=1, **TASKS[task])
    held_rows = [r for r in held if r["prompt"][-1]["content"] not in seen]
    unique: dict[str, dict] = {}
    for r in held_rows:
        unique.setdefault(r["prompt"][-1]["content"], r)
    held_rows = list(unique.values())[:heldout_size]
    if len(held_rows) < heldout_size:
        raise SystemExit(f"only {len(held_rows)} held-out questions are not in the training set; lower the size")
    for name, rows in (("train", train), ("heldout", held_rows)):
        with open(out / f"{task}_{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows)
    print(f"wrote {len(train)} training and {len(held_rows)} held-out problems to {out}")


RANDOM_SHAPES = {  # random-init Llama shapes for B6 throughput runs (SmolLM2's vocabulary and tokenizer)
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64},
    "smollm2-360m": {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 15,
                     "num_key_value_heads": 5, "head_dim": 64},
}  # fmt: skip


def hashed_reward(completions: list, **kwargs) -> list[float]:
    """A reward in [0, 1) from a hash of the completion: random weights never tie a group (no zero-std drops)."""
    import zlib

    return [(zlib.crc32(repr(c).encode()) % 1000) / 1000 for c in completions]


def make_random_model(out: Path, shape: str, tokenizer_dir: Path) -> Path:
    """A random-init fp32 Llama of ``shape`` with SmolLM2's tokenizer: fixed-length completions (sampling at
    temperature 1 over 49,152 tokens meets EOS about once in 49k tokens), so every step has the same work."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**RANDOM_SHAPES[shape], vocab_size=49152, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2, max_position_embeddings=8192, rope_theta=100000.0)  # fmt: skip
    torch.manual_seed(0)
    # on the CPU: this (parent) process must not initialize CUDA, or it could not start an MPS daemon for *_mps modes
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    del model
    for f in tokenizer_dir.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.suffix == ".jinja"):
            shutil.copy(f, out / f.name)
    return out


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_mode(mode: str, a: argparse.Namespace) -> dict:
    """One run (child process): train for ``train_seconds`` of training clock, evaluating as it goes."""
    os.environ["CUDA_VISIBLE_DEVICES"] = a.trainer_gpu
    import torch
    from transformers import AutoTokenizer, TrainerCallback

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.assets import demo_model_dir
    from asyncgrpo.server.launcher import launch_server
    from asyncgrpo.tasks.evaluate import EvalSettings, evaluate_sync
    from asyncgrpo.tasks.reasoning import format_reward, numeric_answer_reward

    train_rows = _read(Path(a.data) / f"{a.task}_train.jsonl")
    held_rows = _read(Path(a.data) / f"{a.task}_heldout.jsonl")[: a.heldout_limit]
    model = Path(a.random_model) if a.random_model else demo_model_dir()
    tok = AutoTokenizer.from_pretrained(model)
    rewards = [hashed_reward] if a.random_model else [numeric_answer_reward, format_reward]
    out_dir = Path(a.work_dir) / mode
    out_dir.mkdir(parents=True, exist_ok=True)

    class Clock(TrainerCallback):
        """Training clock without the evaluations; evaluates every ``eval_every`` s and stops at the budget."""

        def __init__(self, base_url: str) -> None:
            self.settings = EvalSettings(base_url=base_url, max_tokens=a.max_completion_length, temperature=0.0)
            self.t0 = time.perf_counter()
            self.eval_s = 0.0
            self.curve: list[dict] = []
            self.next_eval = 0.0
            self.backend: str | None = None  # the weight sync's backend (ipc when server and trainer share a GPU)

        def train_s(self) -> float:
            return time.perf_counter() - self.t0 - self.eval_s

        def evaluate(self, step: int) -> None:
            t = time.perf_counter()
            clock = self.train_s()
            if a.random_model:  # throughput only: the curve keeps the step counts, no accuracy to measure
                self.curve.append({"train_s": round(clock, 2), "step": step, "accuracy": None})
                self.next_eval = clock + a.eval_every
                return
            got = evaluate_sync(tok, held_rows, [numeric_answer_reward], self.settings)
            acc = got["eval/rewards/numeric_answer_reward/mean"]
            self.curve.append({"train_s": round(clock, 2), "step": step, "accuracy": acc})
            self.eval_s += time.perf_counter() - t
            print(f"[{mode}] step {step:4d}  train {clock:6.1f}s  held-out accuracy {acc:.3f}", flush=True)
            self.next_eval = clock + a.eval_every

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()
            self.evaluate(0)

        def on_step_end(self, args, state, control, **kw):
            self.backend = self.backend or getattr(getattr(trainer, "sender", None), "backend", None)
            clock = self.train_s()
            if clock >= (a.sync_train_seconds if mode == "sync" and a.sync_train_seconds else a.train_seconds):
                control.should_training_stop = True
            elif clock >= self.next_eval:
                self.evaluate(state.global_step)

    server_log = out_dir / "server.log"
    t_start = time.time()
    with launch_server(
        model, extra_args=["--device", a.device, "--dtype", "bfloat16" if a.device == "cuda" else "float32",
                           "--max-model-len", "1024", "--seed", str(a.seed), *a.server_args.split()],
        env={"CUDA_VISIBLE_DEVICES": a.server_gpu, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},  # ipc on one GPU
        log_path=str(server_log), timeout=600,
    ) as server:  # fmt: skip
        args = AsyncGRPOConfig(
            output_dir=str(out_dir),
            max_steps=100_000,  # the clock stops the run
            num_generations=8,
            max_completion_length=a.max_completion_length,
            token_budget=a.token_budget,
            learning_rate=a.learning_rate,
            vllm_server_base_url=server.base_url,
            report_to=[],
            save_strategy="no",
            gradient_checkpointing=a.gradient_checkpointing,
            gradient_accumulation_steps=a.gradient_accumulation_steps,
            bf16=a.device == "cuda",
            use_cpu=a.device == "cpu",
            logging_steps=1,
            seed=a.seed,
            disable_tqdm=True,
            **MODES[mode.removesuffix("_mps")],
        )
        clock = Clock(server.base_url)
        trainer = AsyncGRPOTrainer(
            str(model), reward_funcs=rewards, args=args, train_dataset=train_rows,
            callbacks=[clock],
        )  # fmt: skip
        engine_before = _engine_stats(server.base_url)
        trainer.train()
        trained_s = clock.train_s()
        engine = _engine_delta(engine_before, _engine_stats(server.base_url), trained_s)
        clock.evaluate(trainer.state.global_step)  # the final weights were synced after the last step
        steps = trainer.state.global_step
    metrics = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    per_step = [m for m in metrics if "perf/rollout_wait_s" in m]
    wait = sum(m["perf/rollout_wait_s"] for m in per_step)

    def mean(name: str) -> float | None:
        xs = [m[name] for m in per_step if name in m]
        return sum(xs) / len(xs) if xs else None

    def median(name: str) -> float | None:
        xs = sorted(m[name] for m in per_step if name in m)
        return xs[len(xs) // 2] if xs else None

    return {
        "mode": mode,
        "config": {
            k: getattr(args, k)
            for k in (
                "max_staleness",
                "sync_rollouts",
                "num_generations",
                "max_completion_length",
                "token_budget",
                "learning_rate",
                "gradient_checkpointing",
                "gradient_accumulation_steps",
            )
        },
        "gpu": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu (smoke run)",
        "task": a.task,
        "server_gpu": a.server_gpu,
        "trainer_gpu": a.trainer_gpu,
        "weight_sync_backend": clock.backend,
        "weight_sync_s_mean": mean("perf/weight_sync_s"),
        "steps": steps,
        "train_s": trained_s,
        "eval_s": clock.eval_s,
        "wall_s": time.time() - t_start,
        "steps_per_min": 60.0 * steps / trained_s,
        "rollout_wait_share": wait / trained_s,
        "step_s_median": median("perf/step_s"),
        "rollout_wait_s_median": median("perf/rollout_wait_s"),
        "weight_sync_s_median": median("perf/weight_sync_s"),
        "staleness_mean_median": median("sample/staleness_mean"),
        "fwd_bwd_s_median": median("perf/fwd_bwd_s"),
        # After the warm-up (the first steps compile and autotune: 10-25 s on an H200): steps per minute between the
        # end of step `skip` and the last step, from the metrics' wall-clock stamps.
        "steady_steps_per_min": _steady_rate(per_step, a.steady_skip),
        "samples_per_step_median": median("batch/samples_per_step"),
        "optimizer_s_median": median("perf/optimizer_s"),
        "generated_tokens_per_s_median": median("rollout/generated_tokens_per_s"),
        "completion_mean_length_median": median("completions/mean_length"),
        "server_engine": engine,
        "curve": clock.curve,
        "accuracy_before": clock.curve[0]["accuracy"],
        "accuracy_after": clock.curve[-1]["accuracy"],
    }


def _steady_rate(per_step: list[dict], skip: int) -> float | None:
    """Optimizer steps per minute after the first ``skip`` steps (None when too few steps are left)."""
    stamps = [m["time"] for m in per_step if "time" in m][skip:]
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return None
    return 60.0 * (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _engine_stats(base_url: str) -> dict:
    """The embedded server's step counters and timers (``/server_info``), to tell engine work from idle time."""
    import urllib.request

    with urllib.request.urlopen(f"{base_url}/server_info", timeout=30) as r:
        return json.loads(r.read())["asyncgrpo"].get("engine_step_timings", {})


def _engine_delta(before: dict, after: dict, wall_s: float) -> dict:
    """Per step kind over the run: steps, seconds, ms per step; and the engine's busy share of the wall time
    (evaluations included in the counters, so a slight over-count)."""
    out: dict = {}
    for kind, t in after.items():
        steps = t["steps"] - before.get(kind, {}).get("steps", 0)
        secs = t["seconds"] - before.get(kind, {}).get("seconds", 0.0)
        out[kind] = {"steps": steps, "seconds": round(secs, 3), "ms_per_step": round(1e3 * secs / max(steps, 1), 3)}
    out["busy_frac"] = round(sum(v["seconds"] for v in out.values()) / max(wall_s, 1e-9), 3)
    return out


def time_to_reach(curve: list[dict], target: float) -> float | None:
    """Training seconds at the first evaluation whose accuracy is at least ``target``."""
    return next((p["train_s"] for p in curve if p["accuracy"] >= target), None)


def steps_at(curve: list[dict], train_s: float) -> float:
    """Optimizer steps done after ``train_s`` seconds of training, interpolated between evaluation points."""
    for a, b in itertools.pairwise(curve):
        if a["train_s"] <= train_s <= b["train_s"]:
            span = b["train_s"] - a["train_s"]
            return a["step"] + (b["step"] - a["step"]) * ((train_s - a["train_s"]) / span if span else 1.0)
    return float(curve[-1]["step"])


def compare(runs: dict[str, dict]) -> dict:
    a, s = runs["async"], runs["sync"]
    target = s["accuracy_after"]
    reach = time_to_reach(a["curve"], target) if target is not None else None
    # In the sync run generation and training take turns: its rollout wait is the generation time of a step and
    # the rest of the step is training. B6 asks for a setting where the two are similar (ideal async gain: 2x).
    gen = s["rollout_wait_s_median"] or 0.0
    train = (s["step_s_median"] or 0.0) - gen
    return {
        "sync_generation_s_per_step": gen,
        "sync_training_s_per_step": train,
        "ideal_async_ratio": (gen + train) / max(gen, train, 1e-9),
        "b6_steps_per_min_ratio": a["steps_per_min"] / s["steps_per_min"],
        "b6_steady_steps_per_min_ratio": (a.get("steady_steps_per_min") or 0.0) / (s.get("steady_steps_per_min") or 1e-9),
        "step_s_median_sync_over_async": (s["step_s_median"] or 0.0) / max(a["step_s_median"] or 0.0, 1e-9),
        # The same over the same stretch of training clock (the shorter run's): steps grow heavier as completions
        # shorten (a fixed token_budget takes more samples), so runs of different lengths compare unlike steps.
        "b6_equal_clock_steps_ratio": steps_at(a["curve"], min(a["train_s"], s["train_s"]))
        / max(steps_at(s["curve"], min(a["train_s"], s["train_s"])), 1e-9),
        "async_rollout_wait_share": a["rollout_wait_share"],
        "sync_rollout_wait_share": s["rollout_wait_share"],
        "sync_final_accuracy": target,
        "async_s_to_sync_final_accuracy": reach,
        # None when async never reached it; a target met by the base model (reach 0) says nothing either.
        "b8_sooner_ratio": (s["train_s"] / reach) if reach else None,
        "base_model_meets_sync_final": reach == 0,
        "async_gain_points": None if target is None else 100 * (a["accuracy_after"] - a["accuracy_before"]),
        "sync_gain_points": None if target is None else 100 * (s["accuracy_after"] - s["accuracy_before"]),
        # Time-slicing on one GPU: each side's time per step alone (sync: they take turns) against together (async).
        "fwd_bwd_s_alone_vs_together": [s.get("fwd_bwd_s_median"), a.get("fwd_bwd_s_median")],
        "decode_ms_per_step_alone_vs_together": [s.get("server_engine", {}).get("decode", {}).get("ms_per_step"),
                                                 a.get("server_engine", {}).get("decode", {}).get("ms_per_step")],
        "prefill_ms_per_step_alone_vs_together": [s.get("server_engine", {}).get("prefill", {}).get("ms_per_step"),
                                                  a.get("server_engine", {}).get("prefill", {}).get("ms_per_step")],
    }  # fmt: skip


def compare_mps(runs: dict[str, dict]) -> dict:
    """B6 with MPS: async under MPS against the faster synchronous run (time-sliced, or under MPS when it ran)."""
    syncs = [runs[m] for m in ("sync", "sync_mps") if m in runs]
    best = max(syncs, key=lambda r: r.get("steady_steps_per_min") or 0.0)
    a = runs["async_mps"]
    out = {
        "sync_baseline": best["mode"],
        "b6_mps_steady_steps_per_min_ratio": (a.get("steady_steps_per_min") or 0.0)
        / (best.get("steady_steps_per_min") or 1e-9),
        "b6_mps_steps_per_min_ratio": a["steps_per_min"] / best["steps_per_min"],
        "step_s_median_sync_over_async_mps": (best["step_s_median"] or 0.0) / max(a["step_s_median"] or 0.0, 1e-9),
        "fwd_bwd_s_sync_vs_async_mps": [best.get("fwd_bwd_s_median"), a.get("fwd_bwd_s_median")],
        "decode_ms_per_step_sync_vs_async_mps": [best.get("server_engine", {}).get("decode", {}).get("ms_per_step"),
                                                 a.get("server_engine", {}).get("decode", {}).get("ms_per_step")],
    }  # fmt: skip
    if "async" in runs:
        t = runs["async"]
        out["async_mps_over_async_steady"] = (a.get("steady_steps_per_min") or 0.0) / (
            t.get("steady_steps_per_min") or 1e-9
        )
    return out


def _write_summary(out: str, summary: dict, by_seed: dict[int, dict]) -> None:
    """One seed: ``runs`` and ``compare`` at the top (as before); several: per seed, plus the gains side by side."""
    doc = dict(summary)
    if len(by_seed) == 1:
        doc.update(next(iter(by_seed.values())))
    else:
        doc["seeds"] = {str(s): v for s, v in by_seed.items()}
        doc["gain_points"] = {
            f"{mode}_s{s}": None if r.get("accuracy_after") is None else 100 * (r["accuracy_after"] - r["accuracy_before"])
            for s, v in by_seed.items() for mode, r in v["runs"].items()
        }  # fmt: skip
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_result(out, doc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/learning_h200x2.json")
    p.add_argument("--make-data", help="write the task's JSONL files into this folder and exit")
    p.add_argument("--task", default="basic_arithmetic", choices=sorted(TASKS))
    p.add_argument("--data", default=str(DATA_DIR))
    p.add_argument("--work-dir", default=None, help="run folders (default: beside --out)")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--seeds", default="0", help="comma-separated seeds: every mode runs once per seed")
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # internal: this child's seed
    p.add_argument("--mode", help=argparse.SUPPRESS)  # internal: run one mode in this process
    p.add_argument("--train-seconds", type=float, default=180.0)
    p.add_argument("--sync-train-seconds", type=float, default=None, help="the sync run's budget (default: the same)")
    p.add_argument("--eval-every", type=float, default=30.0)
    p.add_argument("--max-completion-length", type=int, default=128)
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--learning-rate", type=float, default=5e-6)
    p.add_argument("--heldout-limit", type=int, default=None, help="evaluate on the first N held-out problems")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the script")
    p.add_argument("--server-args", default="", help='extra `asyncgrpo serve` flags, e.g. "--max-num-seqs 512"')
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in the backward (heavier training steps: a B6 setting where training "
                        "takes about as long as generation)")  # fmt: skip
    p.add_argument(
        "--random-init",
        choices=sorted(RANDOM_SHAPES),
        default=None,
        help="B6 throughput: a random-init model of this shape (fixed-length completions, hashed reward)",
    )
    p.add_argument("--tokenizer", default=None, help="with --random-init: a folder with SmolLM2's tokenizer files")
    p.add_argument("--random-model", help=argparse.SUPPRESS)  # internal: the random model's folder
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--steady-skip", type=int, default=3, help="warm-up steps left out of steady_steps_per_min")
    p.add_argument("--server-gpu", default="0")
    p.add_argument("--trainer-gpu", default="1")
    a = p.parse_args()
    if a.make_data:
        make_data(Path(a.make_data), a.task)
        return 0
    a.work_dir = a.work_dir or str(Path(a.out).with_suffix(""))
    if a.mode:
        result = run_mode(a.mode, a)
        Path(a.work_dir, f"{a.mode}.json").write_text(json.dumps(result, indent=2))
        return 0
    extra: list[str] = []
    if a.random_init:
        if not a.tokenizer:
            raise SystemExit("--random-init needs --tokenizer (a folder with SmolLM2's tokenizer files)")
        folder = make_random_model(Path(a.work_dir) / f"random-{a.random_init}", a.random_init, Path(a.tokenizer))
        extra = ["--random-model", str(folder)]
    model_what = (
        f"random-init {a.random_init} (fixed-length completions, hashed reward)"
        if a.random_init
        else ("SmolLM2-135M-Instruct")
    )
    summary: dict = {
        "what": f"B6/B8: {model_what}, reasoning-gym {a.task} ({TASKS[a.task]}) prompts, server bf16 on GPU "
        f"{a.server_gpu}, trainer on GPU {a.trainer_gpu} (weight sync: see runs.*.weight_sync_backend); held-out "
        "greedy accuracy against the training clock",
        "note": "the training clock excludes evaluations; during one, the async worker may keep generating up to "
        "its staleness window, the sync worker does not",
        "command": "python bench/learning.py " + " ".join(sys.argv[1:]),
    }
    seeds = [int(x) for x in a.seeds.split(",")]
    by_seed: dict[int, dict] = {}
    for seed in seeds:
        runs: dict[str, dict] = {}
        for mode in a.modes.split(","):
            tag = f"{mode}" if len(seeds) == 1 else f"{mode}_s{seed}"
            cmd = [sys.executable, __file__, "--mode", mode, "--seed", str(seed), *sys.argv[1:], *extra]
            print(f"=== {tag}: {' '.join(cmd[2:])}", flush=True)
            with contextlib.ExitStack() as stack:
                if mode.endswith("_mps"):  # server and trainer as clients of one private MPS daemon
                    from asyncgrpo.server.mps import mps_daemon

                    stack.enter_context(mps_daemon())
                rc = subprocess.call(cmd)
            if rc != 0:
                print(f"the {tag} run failed (exit {rc}); see {a.work_dir}/{mode}/", file=sys.stderr)
                return rc
            runs[mode] = json.loads(Path(a.work_dir, f"{mode}.json").read_text())
            runs[mode]["seed"] = seed
            by_seed[seed] = {"runs": runs}
            if {"async", "sync"} <= runs.keys():
                by_seed[seed]["compare"] = compare(runs)
            if "async_mps" in runs and "sync" in runs:
                by_seed[seed]["compare_mps"] = compare_mps(runs)
            _write_summary(a.out, summary, by_seed)  # after every run: a call cut short keeps what finished
    print(json.dumps({s: v.get("compare", {}) for s, v in by_seed.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

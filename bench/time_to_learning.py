"""Issue 41: how long a run takes to start learning, and what a small step costs, on one GPU (or the CPU demo).

    python bench/time_to_learning.py --out bench/results/time_to_learning_h200.json --baseline-src .baseline/src
    python bench/time_to_learning.py --device cpu --out bench/results/time_to_learning_cpu.json --baseline-src ...

GPU (the shape of the issue): SmolLM2-135M-Instruct (the demo model, or ``--random-init`` for a profile without
it), the embedded server and the trainer on one GPU (weights over ipc), G=8, 256 new tokens at most,
``token_budget`` 1024 (about 900 forwarded tokens a step). Each variant (``--baseline-src``: another checkout's
``src``, run first; then this checkout) runs three times, each in its own process with its own server:
``async_cold`` (an empty compile cache), ``async_warm`` (the cache the cold run left), ``sync_warm``
(``sync_rollouts=True``). Per run: the server's ready time from launch, the first optimizer step after ready and
from launch, every step's duration (step-end stamps), forward+backward per step, recompiles after step 1, and
the server's start log with its times since launch (where the start goes). ``--profile-steps A-B`` runs the torch
profiler over those steps of the async warm run and writes its tables beside the JSON.

CPU: ``asyncgrpo demo`` (the README's main job) per variant: launch to ready, to the first step, and the steps.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.result_file
from bench.result_file import write_result

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "bench" / "data" / "chain_sum_train.jsonl"
GPU_RUNS = {  # name -> (trainer settings, compile cache)
    "async_cold": ({"max_staleness": 2}, "cold"),
    "async_warm": ({"max_staleness": 2}, "warm"),
    "sync_warm": ({"max_staleness": 1, "sync_rollouts": True}, "warm"),
    # the library's default max_staleness (4): twice the rollouts in flight of the runs above
    "async_warm_default": ({}, "warm"),
    # server and trainer as clients of one MPS daemon (server: {mps: true}; docs/gpus.md): kernels side by side
    "async_warm_mps": ({"max_staleness": 2}, "warm"),
    # async_warm under cProfile from launch to step 1's end (its figures are slowed: left out of the checks)
    "async_warm_prof": ({"max_staleness": 2}, "warm"),
}
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (.*)$")


def server_log_times(path: Path, t_launch: float, limit: int = 60) -> list[list]:
    """The server log's first timed lines as [seconds since launch, text] (where the start goes)."""
    out: list[list] = []
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        m = LOG_TIME.match(line)
        if m:
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append([round(t - t_launch, 3), m.group(2)[:200]])
        if len(out) >= limit:
            break
    return out


def step_summary(stamps: list[float], t_ready: float, t_launch: float, per_step: list[dict],
                 profiled: tuple[int, int] | None = None) -> dict:  # fmt: skip
    """Figures of one run from its step-end stamps (stamps[0]: train() began) and per-step metrics.

    ``profiled``: steps (1-based, inclusive) run under the torch profiler: they and the step after them (the
    profiler's trace processing runs after the last one's end stamp) are left out of the slow-step ratio, which is
    also reported with them."""
    durations = [b - a for a, b in itertools.pairwise(stamps)]
    if not durations:
        return {"steps": 0}
    ordered = sorted(durations[2:] or durations)
    median = ordered[len(ordered) // 2]
    late_all = durations[2:]
    kept = [i for i in range(2, len(durations)) if not (profiled and profiled[0] <= i + 1 <= profiled[1] + 1)]
    late = [durations[i] for i in kept]
    # the trainer's own share of a step: its time less the wait for samples (a generation-bound run's steps
    # alternate between waiting and not; this ratio still catches a recompile or a capture inside a step)
    waits = [m.get("perf/rollout_wait_s", 0.0) for m in per_step]
    busy = sorted(durations[i] - waits[i] for i in kept if i < len(waits))
    fwd_bwd = sorted(m["perf/fwd_bwd_s"] for m in per_step[2:] if "perf/fwd_bwd_s" in m)
    steady = stamps[3:]
    slow = [d for d in durations if d > 2 * median]
    return {
        "steps": len(durations),
        "first_step_after_ready_s": stamps[1] - t_ready,
        "time_to_first_step_s": stamps[1] - t_launch,
        "step1_s": durations[0],
        "step2_s": durations[1] if len(durations) > 1 else None,
        "step_s_median_after_2": median,
        "max_step_after_2_over_median": max(late) / median if late else None,
        "max_step_after_2_over_median_incl_profiled": max(late_all) / median if late_all else None,
        "max_busy_after_2_over_median": busy[-1] / busy[len(busy) // 2] if busy else None,
        "profiled_steps": list(profiled) if profiled else None,
        "fwd_bwd_s_median_after_2": fwd_bwd[len(fwd_bwd) // 2] if fwd_bwd else None,
        "steady_steps_per_min": 60.0 * (len(steady) - 1) / (steady[-1] - steady[0]) if len(steady) > 1 else None,
        "warmup_share": sum(slow) / sum(durations),
        "train_s": stamps[-1] - stamps[0],
        "step_s": [round(d, 4) for d in durations],
        "fwd_bwd_s": [round(m.get("perf/fwd_bwd_s", 0.0), 4) for m in per_step],
        "fwd_s": [round(m.get("perf/fwd_s", 0.0), 4) for m in per_step],
        "rollout_wait_s": [round(m.get("perf/rollout_wait_s", 0.0), 4) for m in per_step],
        "weight_sync_s": [round(m.get("perf/weight_sync_s", 0.0), 4) for m in per_step],
        "forwarded_tokens": [m.get("batch/forwarded_tokens") for m in per_step],
        "perf_metrics": {k: v for k, v in per_step[-1].items() if k in PERF_NEW},  # the run's own figures (#41)
    }


# ------------------------------------------------------------------------------------------------- the GPU child
def gpu_child(a: argparse.Namespace) -> dict:
    """One run in this process: launch the server, build the trainer, train ``--steps`` steps, time everything."""
    t_launch = time.time()
    start_prof = None
    if a.child.endswith("_prof"):  # where the trainer's own start goes, call by call (main thread only)
        import cProfile

        start_prof = cProfile.Profile()
        start_prof.enable()
    try:  # as the `asyncgrpo` command does first (server/bytecode.py; the baseline's src may not have it)
        from asyncgrpo.server.bytecode import keep_bytecode

        keep_bytecode()
    except ImportError:
        pass
    # as `asyncgrpo train` does: the server launches first (these imports are light), torch and the trainer after
    try:
        from asyncgrpo.cli.run_server import embedded_env, server_flags
    except ImportError:  # a checkout from before cli/run_server.py (the baseline)
        from asyncgrpo.cli.launch import embedded_env, server_flags
    from asyncgrpo.server import launcher

    settings, _ = GPU_RUNS[a.child]
    model = a.model_dir
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    cuda = a.device == "cuda"  # the CPU: a smoke run of this script
    flags = [*server_flags({"embedded": True, "device": "cuda" if cuda else "cpu"}), "--seed", "0"]
    flags += ["--dtype", "bfloat16" if cuda else "float32"]
    log = work / "server.log"
    parallel = "wait" in inspect.signature(launcher.launch_server).parameters  # start the server, build meanwhile
    kw = {"wait": False} if parallel else {}
    t_server = time.time()  # the server's launch (this child's imports came before it)
    server = launcher.launch_server(model, extra_args=flags, env=embedded_env(flags), log_path=str(log), timeout=600,
                                    **kw)  # fmt: skip
    t_ready = time.time() if not parallel else None
    try:  # as asyncgrpo train (cli/launch.py start_ahead): the rollout worker's process spawned with the server
        from asyncgrpo.cli.launch import start_ahead  # noqa: F401 - only a checkout that does it (not the baseline)
        from asyncgrpo.rollout.worker import RolloutWorker

        early_worker = RolloutWorker(None)
        early_worker.spawn()
    except ImportError:
        early_worker = None
    try:  # as the `asyncgrpo` command: the config's imports without scikit-learn (the baseline's src may lack it)
        from asyncgrpo.cli.launch import import_config
        from asyncgrpo.server import lean_imports

        lean_imports.enable()
        import_config()
    except ImportError:
        pass
    import torch
    from transformers import TrainerCallback

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from asyncgrpo.tasks.reasoning import numeric_answer_reward
    from bench.learning import hashed_reward
    from bench.probes.start_timeline import install

    timeline = install(t_launch)  # the first call of each start phase, seconds since launch
    timeline["child_imports"] = [0.0, round(time.time() - t_launch, 3)]

    reward = hashed_reward if a.random_init else numeric_answer_reward  # random weights: never a tied group
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    args = AsyncGRPOConfig(
        output_dir=str(work), max_steps=a.steps, num_generations=8, max_completion_length=a.max_completion_length, token_budget=1024,
        learning_rate=1e-5, vllm_server_base_url=server.base_url, report_to=[], save_strategy="no", bf16=cuda, use_cpu=not cuda,
        logging_steps=1, seed=0, disable_tqdm=True, **settings,
    )  # fmt: skip
    stamps: list[float] = []
    graphs: list[int] = []
    prof_box: dict = {}
    cpu: list[float] = []

    def unique_graphs() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps.append(time.time())
            cpu.append(time.thread_time())

        def on_step_begin(self, args, state, control, **kw):
            if a.profile_steps and a.child == "async_warm" and state.global_step + 1 == a.profile_steps[0]:
                prof_box["p"] = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                )
                prof_box["p"].__enter__()

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.time())
            graphs.append(unique_graphs())
            cpu.append(time.thread_time())  # this (main) thread's CPU seconds: a step that waits shows less
            if start_prof is not None and state.global_step == 1:
                start_prof.disable()
                _dump_start_profile(start_prof, work)
            if "p" in prof_box and state.global_step == a.profile_steps[1]:
                if cuda:
                    torch.cuda.synchronize()
                prof_box["done"] = prof_box.pop("p")
                prof_box["done"].__exit__(None, None, None)

    trainer = AsyncGRPOTrainer(model, reward_funcs=[reward], args=args, train_dataset=rows,
                               callbacks=[Clock()])  # fmt: skip
    if early_worker is not None:
        trainer.worker_ahead = early_worker
    if parallel and hasattr(trainer, "warm_up_compile"):  # as asyncgrpo train does, while the server starts
        stops = "until" in inspect.signature(trainer.warm_up_compile).parameters  # stops once the server serves
        trainer.warm_up_compile(**({"until": server.answers} if stops else {}))
    t_built = time.time()
    if parallel:
        server.wait_ready()
        t_ready = time.time()
    own_start = _own_start(server.base_url)
    own_ready = own_start.get("ready_s")
    # the server's own ready moment (launch + its ready_s); wait_ready() returns later when the trainer's build
    # took longer than the server's start, and timing from there would hide that wait
    ready_at = t_server + own_ready if own_ready is not None else t_ready
    with server:
        trainer.train()
        if "p" in prof_box:  # the run ended before the last profiled step
            prof_box["done"] = prof_box.pop("p")
            prof_box["done"].__exit__(None, None, None)
        threads = _thread_cpu()
    prof = prof_box.get("done")
    metrics = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    per_step = [m for m in metrics if "perf/step_s" in m]
    out = {
        "run": a.child,
        "settings": settings,
        "parallel_start": parallel,
        "server_ready_s": ready_at - t_server,  # launch to serving (the server's clock where it reports one)
        "wait_ready_returned_s": t_ready - t_server,  # when the trainer, built, found the server ready
        "process_start_to_server_ready_s": ready_at - t_launch,
        "server_own_ready_s": own_ready,
        "server_start": own_start,  # where the server's start went, per process and part (a cold start's split)
        "trainer_built_s": t_built - t_launch,
        **step_summary(stamps, ready_at, t_launch, per_step, profiled=a.profile_steps if prof is not None else None),
        "recompiles_after_step1": graphs[-1] - graphs[0] if graphs else None,
        "unique_graphs": graphs[:3] + graphs[-1:],
        "compile_times": _compile_times(),
        "main_thread_cpu_share_after_2": _cpu_share(stamps, cpu),
        "thread_cpu_s": threads,
        "server_start_log": server_log_times(log, t_launch),
        "start_timeline": dict(sorted(timeline.items(), key=lambda kv: kv[1][0])),
    }
    if a.profile_dir and a.child == "async_warm" and prof is not None:
        Path(a.profile_dir).mkdir(parents=True, exist_ok=True)
        avg = prof.key_averages()
        for key in ("self_cuda_time_total", "self_cpu_time_total", "cpu_time_total"):
            (Path(a.profile_dir) / f"{a.tag}_{key}.txt").write_text(avg.table(sort_by=key, row_limit=45))
        out["profile"] = _profile_totals(prof)
    return out


def _dump_start_profile(prof: Any, work: Path) -> None:
    """The start's cProfile: the raw stats, and its 120 largest cumulative entries without the import machinery, and the 60 largest by own time."""
    import io
    import pstats

    from bench.probes.engine_start_probe import top_cumulative

    prof.dump_stats(str(work / "start.prof"))
    (work / "start_prof.txt").write_text(top_cumulative(work / "start.prof", 120))
    own = io.StringIO()  # where the CPU went by own time (the cumulative view hides a hot leaf under many callers)
    pstats.Stats(str(work / "start.prof"), stream=own).sort_stats("tottime").print_stats(60)
    (work / "start_prof_own.txt").write_text(own.getvalue())


def _own_start(base_url: str) -> dict:
    """The server's own start record (``/server_info``'s ``asyncgrpo``: ``ready_s``, each process's ``start_s`` and
    ``start_parts_s``); empty where it reports none."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base_url}/server_info", timeout=10) as r:
            ours = json.loads(r.read()).get("asyncgrpo", {})
    except OSError:
        return {}
    return {k: ours[k] for k in ("ready_s", "start_s", "start_parts_s") if k in ours}


def _cpu_share(stamps: list[float], cpu: list[float]) -> float | None:
    """Main-thread CPU seconds over wall seconds of the steps after step 2 (below 1: it waited for something)."""
    if len(stamps) < 5 or len(cpu) != len(stamps):
        return None
    return (cpu[-1] - cpu[3]) / max(stamps[-1] - stamps[3], 1e-9)


def _thread_cpu() -> dict:
    """CPU seconds of each thread of this process (who else competed for the GIL during the run)."""
    import threading

    import psutil

    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {}
    for t in psutil.Process().threads():
        busy = t.user_time + t.system_time
        if busy > 0.5:
            out[f"{names.get(t.id, 'native')}:{t.id}"] = round(busy, 2)
    return out


def _compile_times() -> str:
    """Dynamo's per-phase compile seconds of this process (where step 1's compile time went)."""
    try:
        from torch._dynamo.utils import compile_times

        return str(compile_times(repr="str"))[:4000]
    except (ImportError, TypeError, AttributeError) as exc:  # a private API: its absence must not lose the figures
        return f"unavailable: {exc}"


def _profile_totals(prof) -> dict:
    """Over the profiled steps: GPU kernel time, kernel launches, CPU time of the top-level regions."""
    events = prof.key_averages()
    cuda = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in events)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    syncs = {
        e.key: e.count for e in events if "Synchronize" in e.key or e.key in ("aten::item", "aten::_local_scalar_dense")
    }
    return {"gpu_kernel_ms": cuda / 1e3, "kernel_launches": launches, "host_syncs": syncs}


# ------------------------------------------------------------------------------------------------- the CPU child
def cpu_demo(a: argparse.Namespace, src: str, work: Path) -> dict:
    """``asyncgrpo demo`` (the README's main job) with ``src`` first on the path; its start and steps."""
    shutil.rmtree(work, ignore_errors=True)  # an earlier run's server log and metrics.jsonl would be read as this one's
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": src, "TMPDIR": str(work)}  # the embedded server's log lands in work/
    t_launch = time.time()
    cmd = [sys.executable, "-m", "asyncgrpo", "demo", "--max-steps", str(a.steps), "--output-dir", str(work / "out")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    (work / "demo.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"demo failed ({done.returncode}):\n{done.stderr[-3000:]}")
    logs = sorted(work.glob("asyncgrpo-serve-*.log"))
    start = server_log_times(logs[0], t_launch) if logs else []
    ready = next((t for t, text in start if "serving the vLLM" in text), None)
    metrics = [json.loads(x) for x in (work / "out" / "metrics.jsonl").read_text().splitlines()]
    per_step = [m for m in metrics if "perf/step_s" in m]
    first = per_step[0]["time"] if per_step else None
    return {
        "server_ready_s": ready,
        "time_to_first_step_s": first - t_launch if first else None,
        "first_step_after_ready_s": (first - t_launch - ready) if first and ready is not None else None,
        "steps": len(per_step),
        "step_s": [round(m["perf/step_s"], 2) for m in per_step],
        "fwd_bwd_s": [round(m.get("perf/fwd_bwd_s", 0.0), 2) for m in per_step],
        "rollout_wait_s": [round(m.get("perf/rollout_wait_s", 0.0), 2) for m in per_step],
        "wall_s": time.time() - t_launch,
        "perf_metrics": {k: v for k, v in per_step[-1].items() if k in PERF_NEW} if per_step else {},
        "server_start_log": start,
    }


PERF_NEW = ("perf/time_to_first_step_s", "perf/server_ready_s", "perf/warmup_share", "perf/recompiles")


# ------------------------------------------------------------------------------------------------- the parent
def run_gpu_variant(a: argparse.Namespace, tag: str, src: str, work: Path, model_dir: str) -> dict:
    runs: dict = {}
    cache = Path(a.cache_root) / tag  # outside --out's folder: the compile cache is large
    for name, (_, kind) in GPU_RUNS.items():
        only = a.baseline_runs if tag == "baseline" and a.baseline_runs else a.runs
        if only and name not in only.split(","):
            continue
        if kind == "cold":
            shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]),
               "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
               "TORCH_LOGS": "recompiles"}  # fmt: skip
        res = work / tag / f"{name}.json"
        cmd = [sys.executable, __file__, "--child", name, "--work-dir", str(work / tag / name), "--model-dir", model_dir,
               "--steps", str(a.steps), "--child-out", str(res), "--tag", tag,
               "--max-completion-length", str(a.max_completion_length), *(["--random-init"] if a.random_init else []),
               "--device", a.device]  # fmt: skip
        if a.profile_steps:
            cmd += ["--profile-steps", f"{a.profile_steps[0]}-{a.profile_steps[1]}", "--profile-dir", a.profile_dir]
        print(f"=== {tag} {name}", flush=True)
        (work / tag).mkdir(parents=True, exist_ok=True)
        with open(work / tag / f"{name}.log", "w") as log:  # the child's output (recompile reasons included)
            done = subprocess.run(
                cmd, env=env, timeout=a.run_timeout, check=False, stdout=log, stderr=subprocess.STDOUT
            )
        runs[name] = json.loads(res.read_text()) if res.is_file() else {"error": f"exit {done.returncode}"}
        r = runs[name]
        print(f"    ready {r.get('server_ready_s', 0):.1f}s  first step after ready {r.get('first_step_after_ready_s', 0):.1f}s"
              f"  median step {r.get('step_s_median_after_2', 0) or 0:.3f}s  fwd+bwd {r.get('fwd_bwd_s_median_after_2') or 0:.3f}s"
              f"  recompiles {r.get('recompiles_after_step1')}", flush=True)  # fmt: skip
    measured = {k: r for k, r in runs.items() if not k.endswith("_prof")}  # a profiled run is slowed by its profiler
    a_, s_ = runs.get("async_warm", {}), runs.get("sync_warm", {})
    ratio = (a_.get("steady_steps_per_min") or 0) / (s_.get("steady_steps_per_min") or 1e-9)
    cold, warm = runs.get("async_cold", {}), runs.get("async_warm", {})
    checks = {
        "server_ready_le_10s": max(r.get("server_ready_s", 1e9) for r in measured.values()) <= 10.0,
        "first_step_warm_le_5s": warm.get("first_step_after_ready_s", 1e9) <= 5.0,
        "first_step_cold_le_15s": cold.get("first_step_after_ready_s", 1e9) <= 15.0,
        "no_step_after_2_over_2x_median": all((r.get("max_step_after_2_over_median") or 1e9) <= 2.0 for r in measured.values()),
        "steady_fwd_bwd_le_30ms": (warm.get("fwd_bwd_s_median_after_2") or 1e9) <= 0.030,
    }  # fmt: skip
    return {"src": src, "runs": runs, "async_over_sync_steady_steps_per_min": ratio, "checks": checks}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/time_to_learning_h200.json")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--baseline-src", help="another checkout's src/, measured first in the same call")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps a run (GPU 60, CPU demo 4)")
    p.add_argument("--random-init", action="store_true", help="GPU: a random-init SmolLM2-135M (no demo model)")
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--tokenizer", default=".assets/SmolLM2-135M-Instruct-tokenizer")
    p.add_argument("--profile-steps", default=None, help="A-B: torch profiler over these steps of async_warm")
    p.add_argument("--profile-dir", default=None)
    p.add_argument("--cache-root", default="/tmp/time-to-learning-cache", help="compile caches of the runs")
    p.add_argument("--runs", default=None, help="only these runs (comma-separated names of GPU_RUNS)")
    p.add_argument("--baseline-runs", default=None, help="the baseline's runs only (default: --runs)")
    p.add_argument("--run-timeout", type=float, default=280.0)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    p.add_argument("--work-dir", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--tag", default="current", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.profile_steps:
        lo, hi = a.profile_steps.split("-")
        a.profile_steps = (int(lo), int(hi))
        a.profile_dir = a.profile_dir or str(Path(a.out).with_suffix("")) + "_profile"
    if a.child:
        with contextlib.ExitStack() as stack:
            if a.child.endswith("_mps"):  # before this process's first CUDA call, as `asyncgrpo train` does
                from asyncgrpo.server.mps import mps_daemon

                stack.enter_context(mps_daemon())
            out = gpu_child(a)
        Path(a.child_out).write_text(json.dumps(out))
        return 0
    work = Path(a.out).with_suffix("").parent / (Path(a.out).stem + "_runs")
    variants = ([("baseline", str(Path(a.baseline_src).resolve()))] if a.baseline_src else []) + [
        ("current", str(REPO / "src"))
    ]
    if a.device == "cpu":
        a.steps = a.steps or 4
        result = {tag: cpu_demo(a, src, work / tag) for tag, src in variants}
        what = (
            f"asyncgrpo demo --max-steps {a.steps} on this machine's CPU: launch to server ready and to the first step"
        )
    else:
        a.steps = a.steps or 60
        if a.random_init:
            from bench.learning import make_random_model

            model_dir = str(make_random_model(work / "random-135m", "smollm2-135m", Path(a.tokenizer)))
        else:
            from asyncgrpo.assets import demo_model_dir

            model_dir = str(demo_model_dir())
        result = {tag: run_gpu_variant(a, tag, src, work, model_dir) for tag, src in variants}
        name = "SmolLM2-135M" + (" (random init)" if a.random_init else "-Instruct")
        what = (
            f"{name}, embedded server and trainer on one GPU (ipc), G=8, max_completion_length "
            f"{a.max_completion_length}, token_budget 1024, chain_sum prompts"
        )
    write_result(a.out, {"what": what, "command": " ".join(sys.argv), "steps": a.steps, **result})
    print(json.dumps({k: v.get("checks", v.get("time_to_first_step_s")) for k, v in result.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

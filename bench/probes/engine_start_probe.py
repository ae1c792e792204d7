"""Launch to ready of the embedded server as a trainer starts it, cold caches then warm, with where the start goes.

    python bench/probes/engine_start_probe.py --out engine_start.json                  # one GPU (CUDA), 2 runs
    python bench/probes/engine_start_probe.py --out engine_start.json --cprofile       # + each process's profile
    python bench/probes/engine_start_probe.py --out cpu.json --device cpu --runs 1     # the CPU smoke check
    python bench/probes/engine_start_probe.py --out e.json --server-args "--engine-process on"

Each run starts ``asyncgrpo serve`` through ``launch_server(..., wait=False)`` with the flags ``asyncgrpo train``
gives its embedded server (``--gpu-memory-utilization 0.3`` on the trainer's GPU, ``--seed 0``, bf16 on CUDA), for
a random-init checkpoint of SmolLM2-135M's shape (saved with ``save_pretrained``, SmolLM2's tokenizer beside it),
while a "trainer" process beside it imports torch and transformers and loads the same model onto the same device,
as the trainer does during the server's start (``--no-trainer``: the server alone). The runs share one Triton and
one Inductor cache folder, empty before the first run: run 1 is a cold start, run 2 a warm one.

Per run: seconds from the launch to ``/health`` 200, the server's own ``ready_s``, ``start_s`` and
``start_parts_s`` from ``/server_info``, both ready lines of its log parsed into phases and parts, the trainer
side's seconds, and the log's tail. ``--cprofile`` sets ``ASYNCGRPO_START_PROFILE``: the engine process and the HTTP
process each profile their start, written beside ``--out`` as ``<stem>_run<N>_<role>_top40.txt`` (the 40 largest
cumulative entries, the import machinery's own frames left out); ``--keep-prof`` keeps the dumps as well
(``<stem>_run<N>_<role>.prof``; a device machine hands back 8 files at most).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
TOKENIZER = "SmolLM2-135M-Instruct-tokenizer"

TRAINER_SIDE = r"""
import json, sys, time
t0 = time.monotonic()
import torch
t_torch = time.monotonic()
from transformers import AutoModelForCausalLM
t_tf = time.monotonic()
dev = sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
model.to(dev)
with torch.no_grad():
    model(torch.ones(1, 8, dtype=torch.long, device=dev))
if dev == "cuda":
    torch.cuda.synchronize()
t_end = time.monotonic()
print(json.dumps({"torch_import_s": t_torch - t0, "transformers_import_s": t_tf - t_torch,
                  "load_and_forward_s": t_end - t_tf, "total_s": t_end - t0}))
"""


def tokenizer_dir(given: str | None) -> Path:
    """``--tokenizer``, else ``$ASYNCGRPO_CACHE/<TOKENIZER>``, else ``~/.cache/asyncgrpo/<TOKENIZER>``."""
    candidates = [given] if given else []
    if os.environ.get("ASYNCGRPO_CACHE"):
        candidates.append(os.path.join(os.environ["ASYNCGRPO_CACHE"], TOKENIZER))
    candidates.append(os.path.expanduser(f"~/.cache/asyncgrpo/{TOKENIZER}"))
    for c in candidates:
        if (Path(c) / "tokenizer.json").is_file():
            return Path(c)
    raise SystemExit(f"no SmolLM2 tokenizer in {candidates}: pass --tokenizer DIR (a folder with tokenizer.json)")


def make_model(out: Path, tokenizer: Path) -> Path:
    """The random-init checkpoint, built in a child process so this one imports no torch before the launches."""
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[3]); "
            "from bench.learning import make_random_model; "
            "make_random_model(Path(sys.argv[1]), 'smollm2-135m', Path(sys.argv[2]))")  # fmt: skip
    subprocess.run([sys.executable, "-c", code, str(out), str(tokenizer), str(REPO)], check=True, timeout=600)
    return out


def server_flags(device: str, extra: str) -> tuple[list[str], dict[str, str]]:
    """``asyncgrpo train``'s flags and environment for its embedded server (cli/launch.py), plus ``extra``."""
    try:
        from asyncgrpo.cli.run_server import embedded_env
        from asyncgrpo.cli.run_server import server_flags as train_flags
    except ImportError:  # a checkout from before cli/run_server.py
        from asyncgrpo.cli.launch import embedded_env
        from asyncgrpo.cli.launch import server_flags as train_flags

    flags = [*train_flags({"embedded": True, "device": device}), "--seed", "0"]
    flags += ["--dtype", "bfloat16" if device == "cuda" else "float32", *shlex.split(extra)]
    return flags, embedded_env(flags)


_PHASE = re.compile(r"(\w+) ([\d.]+) s(?: \[([^\]]*)\])?")


def parse_phases(text: str) -> dict[str, dict]:
    """``"load 2.1 s [config 0.6, from_pretrained 0.1], kv 0.2 s"`` -> {phase: {"s": 2.1, "parts": {...}}}."""
    out = {}
    for name, secs, parts in _PHASE.findall(text):
        split = {k: float(v) for k, v in (p.rsplit(" ", 1) for p in parts.split(", ") if p)} if parts else {}
        out[name] = {"s": float(secs), "parts": split}
    return out


def ready_lines(log: str) -> dict[str, dict]:
    """The engine's ``engine ready ... started in X s (...)`` and the HTTP process's ``serving ... N s after launch
    (...)`` lines, each as its seconds and phases."""
    out: dict[str, dict] = {}
    for role, pattern in (("engine", r"engine ready: .*started in ([\d.]+) s \((.*)\)\s*$"),
                          ("http", r"serving the vLLM .* ([\d.]+) s after launch \((.*)\)\s*$")):  # fmt: skip
        for line in log.splitlines():
            m = re.search(pattern, line)
            if m:
                out[role] = {"s": float(m.group(1)), "phases": parse_phases(m.group(2))}
    return out


_MACHINERY = ("<frozen ", "importlib/__init__.py", "built-in method builtins.exec", "built-in method builtins.__import__",
              "built-in method builtins.hasattr", "method 'acquire'")  # fmt: skip


def top_cumulative(prof: Path, n: int = 40) -> str:
    """The ``n`` largest cumulative entries of a cProfile dump, the import machinery's own frames left out."""
    import pstats

    stats = pstats.Stats(str(prof))
    rows = []
    for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{file}:{line}({func})" if file != "~" else func
        if any(m in where for m in _MACHINERY):
            continue
        rows.append((cumtime, tottime, ncalls, re.sub(r".*/(site|dist)-packages/", "", where)))
    rows.sort(reverse=True)
    head = f"{'cumulative':>10} {'own':>8} {'calls':>8}  function ({stats.total_tt:.2f} s profiled)"  # type: ignore[attr-defined]
    return "\n".join([head, *(f"{c:10.3f} {t:8.3f} {k:8d}  {w}" for c, t, k, w in rows[:n])]) + "\n"


def server_info(base_url: str) -> dict:
    with urllib.request.urlopen(base_url + "/server_info", timeout=30) as r:
        ours = json.loads(r.read()).get("asyncgrpo", {})
    return {k: ours.get(k) for k in ("ready_s", "start_s", "start_parts_s")}


def run_once(n: int, model: Path, a: argparse.Namespace, caches: Path, out: Path) -> dict:
    """One launch as the trainer does it, with the trainer side beside it; returns what it measured."""
    from asyncgrpo.server import launcher

    flags, env = server_flags(a.device, a.server_args)
    env.update(TRITON_CACHE_DIR=str(caches / "triton"), TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"))
    profile = caches.parent / f"profile{n}"
    if a.cprofile:
        env["ASYNCGRPO_START_PROFILE"] = str(profile)
    log = caches.parent / f"server{n}.log"
    t0 = time.monotonic()
    server = launcher.launch_server(model, extra_args=flags, env=env, log_path=log, timeout=a.timeout, wait=False)
    trainer = None
    if not a.no_trainer:  # the trainer's side: its own imports and model load, in parallel with the server's start
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER_SIDE, str(model), a.device], stdout=subprocess.PIPE,
                                   text=True, env={**os.environ, **env})  # fmt: skip
    result: dict = {"run": n, "caches": "cold" if n == 1 else "warm", "flags": flags, "trainer_side": None}
    with server:
        server.wait_ready()
        result["launch_to_health_s"] = round(time.monotonic() - t0, 3)
        result.update(server_info(server.base_url))
    if trainer is not None:
        stdout, _ = trainer.communicate(timeout=a.timeout)
        result["trainer_side"] = json.loads(stdout.strip().splitlines()[-1]) if trainer.returncode == 0 else None
    text = log.read_text(errors="replace")
    result["log_ready_lines"] = ready_lines(text)
    result["log_tail"] = text[-3000:]
    for prof in sorted(profile.glob("*_start.prof")) if a.cprofile else []:
        role = prof.name.removesuffix("_start.prof")
        stem = out.with_suffix("").name
        (out.parent / f"{stem}_run{n}_{role}_top40.txt").write_text(top_cumulative(prof))
        if a.keep_prof:
            shutil.copy(prof, out.parent / f"{stem}_run{n}_{role}.prof")
    return result


def brief(r: dict) -> str:
    lines = [f"run {r['run']} ({r['caches']}): launch to /health {r['launch_to_health_s']:.1f} s, own ready "
             f"{r.get('ready_s')} s" + (f", trainer side {r['trainer_side']['total_s']:.1f} s"
                                        if r.get("trainer_side") else "")]  # fmt: skip
    for role, line in r["log_ready_lines"].items():
        lines.append(f"  {role} {line['s']:.1f} s: " + ", ".join(
            f"{k} {v['s']:.1f}" + (" [" + ", ".join(f"{p} {s:.1f}" for p, s in v["parts"].items()) + "]"
                                   if v["parts"] else "") for k, v in line["phases"].items()))  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON result (profiles land beside it)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--runs", type=int, default=2, help="starts in a row on one cache folder (1: cold, then warm)")
    ap.add_argument("--cprofile", action="store_true", help="profile each server process's start (cProfile)")
    ap.add_argument("--keep-prof", action="store_true", help="with --cprofile: keep the .prof dumps too")
    ap.add_argument("--no-trainer", action="store_true", help="the server alone: no trainer side loading meanwhile")
    ap.add_argument("--model", default=None, help="a checkpoint folder (default: a random-init SmolLM2-135M shape)")
    ap.add_argument("--tokenizer", default=None, help=f"folder of {TOKENIZER} (default: $ASYNCGRPO_CACHE, ~/.cache)")
    ap.add_argument("--server-args", default="", help='more `asyncgrpo serve` flags, one string ("--enforce-eager")')
    ap.add_argument("--timeout", type=float, default=300.0, help="bound on one start, seconds")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="engine-start-probe-"))
    model = Path(a.model) if a.model else make_model(work / "model", tokenizer_dir(a.tokenizer))
    (work / "caches").mkdir()
    result: dict = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "model": str(model), "runs": []}
    for n in range(1, a.runs + 1):
        r = run_once(n, model, a, work / "caches", out)
        result["runs"].append(r)
        print(brief(r), flush=True)
        from bench.result_file import write_result

        write_result(out, result)  # after each run: a cut probe keeps what it measured
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

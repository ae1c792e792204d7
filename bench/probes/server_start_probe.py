"""Launch to ``/health`` of the embedded server, one checkout's ``src`` after another, on the same clock.

    python bench/probes/server_start_probe.py --srcs baseline=.baseline/src current=src --out server_start.json

Each server is the one ``asyncgrpo train`` embeds on the trainer's GPU (``--gpu-memory-utilization 0.3``,
bf16) serving a random-init SmolLM2-135M, started alone (no trainer beside it) with empty Triton and Inductor
caches of its own, timed from ``Popen`` to the first ``/health`` 200; ``/server_info``'s own start split is kept
where the server reports one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.result_file import write_result


def start_once(src: str, model: str, device: str, timeout: float) -> dict:
    """One server: seconds from Popen to /health 200, then its /server_info start split."""
    port = 8000 + os.getpid() % 1000
    cache = tempfile.mkdtemp(prefix="server-start-cache-")
    env = {**os.environ, "PYTHONPATH": src, "TRITON_CACHE_DIR": f"{cache}/triton",
           "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor"}  # fmt: skip
    flags = ["--device", device, "--port", str(port)]
    if device == "cuda":
        flags += ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.3"]
    log = open(Path(cache) / "server.log", "w")  # noqa: SIM115 - the child writes it until stopped
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "asyncgrpo", "serve", model, *flags], env=env, stdout=log,
                            stderr=subprocess.STDOUT)  # fmt: skip
    ready = None
    info: dict = {}
    try:
        while time.perf_counter() - t0 < timeout and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        ready = time.perf_counter() - t0
                        break
            except OSError:
                time.sleep(0.05)
        if ready is not None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=10) as r:
                own = json.loads(r.read()).get("asyncgrpo", {})
            info = {k: own[k] for k in ("ready_s", "start_s") if k in own}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return {"launch_to_health_s": ready, **info, "log_tail": (Path(cache) / "server.log").read_text()[-1500:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--srcs", nargs="+", required=True, help="name=path of a checkout's src, in order")
    ap.add_argument("--model", default=None, help="a model folder (default: a random-init SmolLM2-135M)")
    ap.add_argument("--tokenizer", default=".assets/SmolLM2-135M-Instruct-tokenizer")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=float, default=90.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = a.model
    if model is None:
        from bench.learning import make_random_model

        model = str(make_random_model(Path(tempfile.mkdtemp()) / "m", "smollm2-135m", Path(a.tokenizer)))
    result: dict = {"what": __doc__.splitlines()[0], "command": " ".join(sys.argv), "runs": {}}
    for spec in a.srcs:
        name, src = spec.split("=", 1)
        r = start_once(str(Path(src).resolve()), model, a.device, a.timeout)
        result["runs"][name] = r
        print(name, "launch to health", r["launch_to_health_s"], "own", r.get("ready_s"), flush=True)
        write_result(a.out, result)  # after each: a cut run keeps what it measured
    return 0


if __name__ == "__main__":
    sys.exit(main())

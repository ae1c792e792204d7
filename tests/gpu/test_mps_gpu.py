"""The run's private MPS daemon on a real GPU: clients join it, the embedded server serves under it, it goes away.

Run on a machine with a GPU: ``python -m pytest -q -s -m gpu tests/gpu/test_mps_gpu.py``. The daemon is started
in a fresh child process (as ``asyncgrpo train`` does, before any CUDA call): the pytest process has usually
initialized CUDA already, which :func:`mps_problem` refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncgrpo.server.mps import mps_problem

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]
ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, subprocess, sys
from pathlib import Path
from asyncgrpo.server.launcher import launch_server
from asyncgrpo.server.mps import MPS_CONTROL, MPS_ENV, mps_daemon
from tests.helpers.reference import server_greedy, write_tiny_llama

def control(env, command):
    r = subprocess.run([MPS_CONTROL], input=command + "\n", env={**os.environ, **env}, capture_output=True,
                       text=True, timeout=30, check=True)
    return r.stdout.split()

model_dir = write_tiny_llama(Path(sys.argv[1]) / "m")
out = {}
with mps_daemon() as env:
    out["env_set"] = all(os.environ[k] == env[k] for k in MPS_ENV)
    out["servers"] = control(env, "get_server_list")
    # a fixed KV cache: in a suite run, the pytest process still holds GiBs of earlier tests on this GPU, which a
    # small --gpu-memory-utilization share counts as used (on an H200: "only 0 KV-cache tokens fit" at 0.05)
    with launch_server(model_dir, extra_args=["--device", "cuda", "--gpu-memory-utilization", "0.05",
                                              "--kv-cache-tokens", "8192"], timeout=300) as server:
        tokens, _ = server_greedy(server.base_url)
        out["tokens"] = [int(t) for t in tokens] if isinstance(tokens, list) else str(tokens)
        out["clients"] = control(env, f"get_client_list {out['servers'][0]}")
out["pipe_removed"] = not Path(env[MPS_ENV[0]]).exists()
out["env_restored"] = all(os.environ.get(k) != env[k] for k in MPS_ENV)
print("RESULT " + json.dumps(out))
"""


@pytest.mark.skipif(mps_problem() is not None and "PATH" in (mps_problem() or ""), reason="no MPS control here")
def test_the_embedded_server_serves_as_a_client_of_the_run_daemon(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=420, check=False, cwd=ROOT)  # fmt: skip
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, f"child failed ({r.returncode}): {r.stderr[-3000:]}"
    out = json.loads(line[len("RESULT ") :])
    assert out["env_set"]
    assert len(out["servers"]) == 1, out  # the daemon's check client started one MPS server
    assert out["tokens"]
    assert out["clients"], "the embedded server's engine did not join the MPS server"
    assert out["pipe_removed"] and out["env_restored"]


def test_a_process_whose_cuda_is_initialized_cannot_join() -> None:
    torch.zeros(1, device="cuda")
    problem = mps_problem()
    assert problem is not None and ("not on PATH" in problem or "already initialized" in problem)

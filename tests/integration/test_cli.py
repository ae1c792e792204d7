"""``asyncgrpo`` as a user runs it: real processes, exit codes, timings and what gets printed.

One module-scoped ``asyncgrpo train`` run on the tiny model (embedded CPU server, eval_dataset) feeds the
checks on its saved model, its summary, ``asyncgrpo eval`` and ``asyncgrpo report``.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def asyncgrpo(*argv: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "asyncgrpo", *argv],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        check=False,
        text=True,
        timeout=timeout,
    )


def timed(*argv: str, **kw) -> tuple[subprocess.CompletedProcess, float]:
    """The process and the seconds it cost: CPU time (user + sys) of the child, which the 15 s budget is about.

    Wall time on the shared 2-core test machine depends on what else runs (several test suites at once can
    triple it); it is bounded separately with a generous margin so a hang still fails.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    out = asyncgrpo(*argv, **kw)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert wall < 60, f"{argv}: {wall:.1f} s wall"
    return out, cpu


# ---- mistakes: exit 2 fast, one message, no traceback ----------------------------------------------------------------
def test_config_mistake_exits_2_fast(tmp_path):
    cfg = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    cfg["server"]["embeded"] = cfg["server"].pop("embedded")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out, seconds = timed("train", "--config", str(tmp_path / "run.yaml"), timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr and "did you mean 'embedded'?" in out.stderr
    assert seconds < 15, f"took {seconds:.1f} s of CPU"


def test_unreachable_server_exits_2_fast(tmp_path):
    cfg = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg["server"] = {"wait_s": 1}
    cfg["args"]["vllm_server_base_url"] = f"http://127.0.0.1:{port}"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    out, seconds = timed("train", "--config", str(tmp_path / "run.yaml"), timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"no generation server answers at http://127.0.0.1:{port}" in out.stderr
    assert seconds < 15, f"took {seconds:.1f} s of CPU"


def test_serve_busy_port_exits_before_loading(tiny_llama_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out, seconds = timed("serve", str(tiny_llama_dir), "--port", str(port), "--device", "cpu", timeout=60)
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "--port" in out.stderr
    assert "Traceback" not in out.stderr and "loading" not in out.stderr.lower()
    assert seconds < 15, f"took {seconds:.1f} s of CPU"


def test_serve_hub_id_not_cached_offline(tmp_path):
    out, seconds = timed(
        "serve", "some-org/some-model", timeout=60, env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    )
    assert out.returncode == 2
    assert "model some-org/some-model is not in the Hugging Face cache" in out.stderr and "HF_HUB_OFFLINE" in out.stderr
    assert seconds < 15


def test_serve_help_shows_defaults():
    out = asyncgrpo("serve", "--help", timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "--host HOST address to listen on (default: 127.0.0.1)" in text
    assert "--port PORT port to listen on (default: 8000)" in text


def test_serve_hub_id_from_the_cache(tmp_path, tiny_llama_dir):
    """A hub id resolves through the HF cache layout (offline): the server loads it and serves it by that name."""
    snapshot = tmp_path / "models--tiny-org--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_llama_dir, snapshot)
    (tmp_path / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0" * 40)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncgrpo",
            "serve",
            "tiny-org/tiny-llama",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--max-model-len",
            "64",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        import urllib.request

        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                    models = json.load(r)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not answer /v1/models within 240 s"
                time.sleep(0.5)
        assert models["data"][0]["id"] == "tiny-org/tiny-llama"
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM is a clean stop
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)

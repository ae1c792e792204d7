"""What every benchmark JSON says about where it came from: ``commit``, ``date`` and ``hardware``, first.

A figure is only comparable to another taken on the same code and machine, so each script writes its result
through ``write_result`` instead of ``json.dumps`` alone (``bench/LOG.md`` is the journal of past results).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def current_commit() -> str:
    """HEAD of the checkout (``+dirty`` when src/ or bench/ differ from it); ``ASYNCGRPO_COMMIT`` where there is no
    git (a copied tree on a GPU machine)."""
    if os.environ.get("ASYNCGRPO_COMMIT"):
        return os.environ["ASYNCGRPO_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        dirty = (
            subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "src", "bench"], cwd=REPO, check=False).returncode
            != 0
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty else "")


def current_hardware() -> str:
    """``"2x NVIDIA H200"``, or the CPU and its core count when no CUDA device is visible."""
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    return f"cpu {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def stamped(result: dict[str, Any], hardware: str | None = None) -> dict[str, Any]:
    """``result`` with ``commit``, ``date`` (UTC, ISO 8601) and ``hardware`` in front of its own keys."""
    head = {
        "commit": current_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": hardware or current_hardware(),
    }
    return {**head, **{k: v for k, v in result.items() if k not in head}}


def write_result(path: str | os.PathLike, result: dict[str, Any], hardware: str | None = None, indent: int = 2) -> None:
    """Write ``stamped(result)`` as JSON to ``path``."""
    Path(path).write_text(json.dumps(stamped(result, hardware), indent=indent) + "\n")

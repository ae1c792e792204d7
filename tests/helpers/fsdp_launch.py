"""Launching the real trainer on several processes for the tests, the way ``torchrun`` launches a user's script.

``launch_ranks(spec, nproc)`` runs ``python -m torch.distributed.run --standalone --nproc-per-node N
tests/helpers/fsdp_train.py SPEC.json`` and returns the parsed ``result.json`` the ranks wrote; on a non-zero
exit, the error carries the log tail. ``allow_fsdp_on_cpu`` is the one shim the CPU tests need: accelerate
only turns FSDP on for accelerator devices, so on a CPU-only machine (gloo) it would fall back to DDP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("fsdp_train.py")
REPO = Path(__file__).resolve().parents[2]


def allow_fsdp_on_cpu() -> None:
    """Let accelerate's FSDP2 plugin apply to a multi-process CPU (gloo) run, as it does on GPUs."""
    from accelerate import state

    original = state.AcceleratorState.__init__
    if getattr(original, "_asyncgrpo_cpu_fsdp", False):
        return

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == state.DistributedType.MULTI_CPU:
            self.distributed_type = state.DistributedType.FSDP
            if self._mixed_precision != "no":  # as accelerate does on GPUs
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin

    init._asyncgrpo_cpu_fsdp = True  # type: ignore[attr-defined]
    state.AcceleratorState.__init__ = init


def launch_ranks(spec: dict[str, Any], nproc: int, workdir: Path, timeout: float = 240.0) -> dict[str, Any]:
    """Run ``fsdp_train.py`` on ``nproc`` CPU processes with ``spec``; returns rank 0's ``result.json``."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / "launch.log"
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(SCRIPT), str(spec_path)]  # fmt: skip
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd, check=False, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout, cwd=REPO
            )
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{nproc}-process run still going after {timeout:.0f}s; log tail:\n"
                                 f"{log_path.read_text()[-4000:]}") from None  # fmt: skip
    if proc.returncode != 0:
        raise AssertionError(f"{nproc}-process run exited {proc.returncode}; log tail:\n{log_path.read_text()[-6000:]}")
    return json.loads((Path(spec["dump_dir"]) / "result.json").read_text())

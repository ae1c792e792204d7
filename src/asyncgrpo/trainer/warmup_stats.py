"""The run's start-up and warm-up figures: how long until training ran, and how much of it warm-up cost.

A short run on a small model can spend most of its time before and around its first steps (server start, model
load, compiles, first kernels), which per-step means hide. Four metrics say so (``STARTUP_METRICS`` in
``asyncgrpo.metrics``; docs/metrics.md, "Start-up and warm-up"):

- ``perf/time_to_first_step_s``: this trainer process's start (the OS's record of it, so imports and model loading
  count) to the end of its first optimizer step; logged once, in the window of that step;
- ``perf/server_ready_s``: the generation server's own seconds from its process start to serving, as its
  ``/server_info`` reports them (the embedded server does; a vLLM server does not, then nothing is logged);
- ``perf/warmup_share``: the share of the training time so far spent in steps slower than twice the median step;
- ``perf/recompiles``: torch.compile graphs built after the first step (``trainer/recompiles.py``), a running total,
  logged once anything was compiled.

``warmup_share`` and ``recompiles`` describe the run so far, not the window: they are added once per logged window
(at the step that will be logged), so the window's value is the figure at its end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from asyncgrpo.metrics import MetricsWindow, warmup_share
from asyncgrpo.trainer.recompiles import RecompileCounter

logger = logging.getLogger(__name__)


def process_start_time() -> float:
    """This process's start as a Unix time: the OS's record (psutil, which accelerate requires), else now."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception as exc:  # noqa: BLE001 - a sandbox without /proc: the figure then starts late, nothing fails
        logger.info("no process start time (%s): perf/time_to_first_step_s counts from the trainer's set-up", exc)
        return time.time()


class StartupMetrics:
    """Fills the four metrics into the trainer's window after each optimizer step (rank 0).

    Args:
        process_start: this process's start as a Unix time (default: the OS's record).
    """

    def __init__(self, process_start: float | None = None) -> None:
        self.process_start = process_start if process_start is not None else process_start_time()
        self.recompiles = RecompileCounter()
        self.time_to_first_step_s: float | None = None

    def step_done(
        self,
        window: MetricsWindow,
        step: int,
        durations: Sequence[float],
        will_log: bool,
        server_ready_s: float | None = None,
    ) -> None:
        """After optimizer step ``step``, whose duration is ``durations[-1]`` (every step of this process so far).

        ``will_log``: the trainer logs a window at this step (the run-so-far figures go into that window only).
        """
        first = len(durations) == 1
        if first:
            self.time_to_first_step_s = time.time() - self.process_start
            window.add("perf/time_to_first_step_s", self.time_to_first_step_s)
            if server_ready_s is not None:
                window.add("perf/server_ready_s", server_ready_s)
            self.recompiles.start()
        total = self.recompiles.check(step)
        if will_log:
            window.add("perf/warmup_share", warmup_share(durations))
            if self.recompiles.ever_compiled:
                window.add("perf/recompiles", total)

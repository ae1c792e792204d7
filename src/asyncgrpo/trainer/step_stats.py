"""``StepStats``: one optimizer step's timings and counts, the seam between the trainer and its callback.

The trainer owns one record: it starts it when it fetches a step's batches and adds each
micro-batch's forward+backward; the callback reads it after
the optimizer step to fill the step's ``perf/*`` metrics (M3). Nothing else crosses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncgrpo.metrics import MetricsWindow, mfu


class PassClock:
    """Times one micro-batch's forward and forward+backward with a single device sync, at the end.

    A sync between the passes (as the step had) leaves the GPU idle while the host queues the backward, and on a
    GPU time-sliced with the server it also waits out the server's turn. On CUDA the forward's share is read from
    two events instead (GPU time from the forward's first kernel to its last); elsewhere from the wall clock.
    """

    def __init__(self, device: str | torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.t0 = time.perf_counter()
        self.start, self.mid, self.mid_wall = self._event(), None, self.t0

    def _event(self) -> Any:
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def forward_done(self) -> None:
        self.mid, self.mid_wall = self._event(), time.perf_counter()

    def finish(self) -> tuple[float, float]:
        """(forward+backward, forward) seconds; syncs the device once."""
        if self.cuda:
            torch.cuda.synchronize()
        total = time.perf_counter() - self.t0
        fwd = self.start.elapsed_time(self.mid) / 1e3 if self.mid is not None else self.mid_wall - self.t0
        return total, min(fwd, total)


@dataclass
class StepStats:
    """Timings (seconds) and token counts of the current optimizer step on this process.

    Args:
        flops_per_token: the model's training FLOPs per forwarded token (None: unknown architecture).
        peak_flops: this device's peak FLOP/s at the training precision (None: unknown, e.g. CPU).
    """

    flops_per_token: float | None = None
    peak_flops: float | None = None
    started_at: float = field(default_factory=time.perf_counter)
    fwd_bwd_s: float = 0.0
    fwd_s: float = 0.0  # the forward passes alone (perf/fwd_s)
    optimizer_s: float = 0.0  # the optimizer step (perf/optimizer_s), timed by the callback's optimizer hooks
    num_tokens_total: float = 0.0  # num_tokens: forwarded tokens since the run began (a running total)
    forwarded_tokens: int = 0  # this process's forwarded tokens (shared prefixes once)
    micro_batches: list[Any] = field(default_factory=list)  # rank 0: the step's micro-batches, for step_done
    step_durations: list[float] = field(default_factory=list)  # perf/step_s of every step recorded (warm-up share)

    def begin(self) -> None:
        """A new step starts (before its samples are awaited: ``perf/step_s`` includes the wait)."""
        self.started_at = time.perf_counter()
        self.fwd_bwd_s = 0.0
        self.fwd_s = 0.0
        self.optimizer_s = 0.0
        self.forwarded_tokens = 0
        self.micro_batches = []

    def add_forward_backward(self, seconds: float, tokens: int, forward_s: float = 0.0) -> None:
        self.fwd_bwd_s += seconds
        self.fwd_s += forward_s
        self.forwarded_tokens += tokens

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started_at

    def record(self, window: MetricsWindow, trained_tokens: int, world_size: int) -> None:
        """Add the finished step's ``perf/*`` metrics to ``window`` and its tokens to ``num_tokens_total``.

        Every process forwards a row of about the same size, so this process's count × ``world_size``
        stands for the step's forwarded tokens.
        """
        step_s = self.elapsed_s()
        self.step_durations.append(step_s)
        forwarded = self.forwarded_tokens * world_size
        window.add("perf/step_s", step_s)
        window.add("perf/fwd_bwd_s", self.fwd_bwd_s)
        window.add("perf/fwd_s", self.fwd_s)
        window.add("perf/optimizer_s", self.optimizer_s)
        window.add_ratio("perf/fwd_bwd_forwarded_tokens_per_s", forwarded, self.fwd_bwd_s)
        window.add_ratio("perf/wall_clock_forwarded_tokens_per_s", forwarded, step_s)
        window.add_ratio("perf/wall_clock_trained_tokens_per_s", trained_tokens, step_s)
        self.num_tokens_total += float(forwarded)  # logged as a running total (transformers' convention)
        if self.peak_flops and self.flops_per_token and self.fwd_bwd_s > 0:
            fpt, peak = self.flops_per_token, self.peak_flops
            window.add("perf/fwd_bwd_mfu", mfu(forwarded, fpt, self.fwd_bwd_s, peak, world_size))
            window.add("perf/wall_clock_mfu", mfu(forwarded, fpt, step_s, peak, world_size))

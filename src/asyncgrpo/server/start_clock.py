"""Where a server's start goes: seconds per phase, counted from the start of the process.

The server logs one line per process when it is ready (the engine's at ``engine ready``, the HTTP process's at
``serving``) and reports both in ``/server_info`` (``asyncgrpo.start_s``, ``asyncgrpo.ready_s``), so a trainer or a
benchmark can see which part of a slow start to look at: the interpreter and its imports, the model load, the KV
cache, kernel warm-up, CUDA graphs, the tokenizer, the app.
"""

from __future__ import annotations

import os
import time
from typing import Any

_IMPORTED = time.monotonic()  # fallback origin where the process's own start time cannot be read
PROFILE_ENV = "ASYNCGRPO_START_PROFILE"  # a folder: each server process writes a cProfile of its start there


def process_age_s() -> float:
    """Seconds since this process started (Linux: its start tick in ``/proc``; elsewhere: since this module's import).

    The kernel's start tick counts from boot like ``CLOCK_BOOTTIME``, so the difference is exact to a tick (10 ms),
    unlike the wall-clock ``create_time`` of psutil, whose boot time is rounded to the second.
    """
    try:
        with open(f"/proc/{os.getpid()}/stat", "rb") as fh:
            stat = fh.read()
        start_ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22; the name in (...) may hold spaces
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        if 0.0 <= age < 7 * 86400:
            return age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    return time.monotonic() - _IMPORTED


class StartClock:
    """Phases of a start in order. ``from_process``: the first phase runs from the process's start (its interpreter
    and imports), else from now (an engine built inside a process that did other things first)."""

    def __init__(self, from_process: bool = True, role: str | None = None) -> None:
        self._profile = _start_profile() if role else None
        self.role = role
        now = time.monotonic()
        self.origin = now - process_age_s() if from_process else now
        self.phases: dict[str, float] = {}
        self.parts: dict[str, dict[str, float]] = {}  # phase -> its parts in order, where the phase took any
        self._open: dict[str, float] = {}  # parts of the phase the next mark closes
        self._last = self._last_part = self.origin

    def part(self, name: str) -> None:
        """Close ``name``, a part of the phase the next :meth:`mark` closes (it ran since the previous mark or part).

        The phase keeps its one figure (tests and benchmarks read the phase names); its parts say where inside it
        the time went (``parts``, the ready line's brackets, ``/server_info``'s ``asyncgrpo.start_parts_s``)."""
        now = time.monotonic()
        self._open[name] = self._open.get(name, 0.0) + now - self._last_part
        self._last_part = now

    def mark(self, phase: str) -> float:
        """Close ``phase`` (it ran since the previous mark); returns its seconds. A repeated name adds up.

        Where parts were taken, the time after the last one is the part ``other``, so the parts add up to the
        phase."""
        now = time.monotonic()
        seconds = now - self._last
        self.phases[phase] = round(self.phases.get(phase, 0.0) + seconds, 3)
        if self._open:
            self._open["other"] = self._open.get("other", 0.0) + now - self._last_part
            into = self.parts.setdefault(phase, {})
            for name, s in self._open.items():
                into[name] = round(into.get(name, 0.0) + s, 3)
            self._open = {}
        self._last = self._last_part = now
        return seconds

    def ready(self) -> None:
        """The start is over: with ``ASYNCGRPO_START_PROFILE`` set, the profile since this clock's creation is written
        to ``<folder>/<role>_start.prof`` (``bench/probes/engine_start_probe.py --cprofile`` reads it)."""
        if self._profile is None:
            return
        self._profile.disable()
        folder = os.environ[PROFILE_ENV]
        os.makedirs(folder, exist_ok=True)
        self._profile.dump_stats(os.path.join(folder, f"{self.role}_start.prof"))
        self._profile = None

    def since_start(self) -> float:
        return round(time.monotonic() - self.origin, 3)

    def text(self) -> str:
        """``"process 3.1 s, load 2.0 s [config 0.1, from_pretrained 1.2], ..."`` for the ready line (parts of
        0.05 s and more)."""
        out = []
        for phase, seconds in self.phases.items():
            parts = [f"{k} {v:.1f}" for k, v in self.parts.get(phase, {}).items() if v >= 0.05]
            out.append(f"{phase} {seconds:.1f} s" + (f" [{', '.join(parts)}]" if parts else ""))
        return ", ".join(out)


def _start_profile() -> Any:  # a cProfile.Profile where asked for (imported only then)
    if not os.environ.get(PROFILE_ENV):
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    return prof

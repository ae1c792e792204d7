"""Counting torch.compile's recompilations after the first optimizer step (``perf/recompiles``).

A compiled graph that is built again after step 1 costs a compile (seconds to minutes) in the middle of training,
and steady steps should build none. Dynamo keeps both facts in process-wide tables that are filled whether or not
its logging is on, so reading them needs no logging set-up that would change what the user's ``TORCH_LOGS`` prints:

- ``torch._dynamo.utils.counters["stats"]["unique_graphs"]``: graphs built so far (the count);
- ``torch._dynamo.utils.guard_failures``: per code object, the text of each failed guard that sent a call back to
  the compiler (``"[0/0]: tensor 'x' size mismatch at index 0. expected 3, actual 5"``), the cause.

Both are private; on a torch where either is missing or shaped otherwise the count falls back to 0 or the cause to
"cause unknown", never to an error. Dynamo is never imported here: a process that did not load it compiled nothing.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

CAUSE_UNKNOWN = "cause unknown"
MAX_CAUSE_CHARS = 400  # one guard's text; the whole guard list of a verbose failure can run to pages


def _dynamo_utils() -> Any | None:
    if "torch._dynamo" not in sys.modules:
        return None
    return sys.modules.get("torch._dynamo.utils")


def graphs_built() -> int:
    """Dynamo graphs built so far in this process (0 without dynamo, or on a torch without the counter)."""
    utils = _dynamo_utils()
    try:
        return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0
    except (AttributeError, KeyError, TypeError, ValueError):
        return 0


def _failures() -> dict[Any, list[str]]:
    """``{code object: [guard failure text, ...]}`` as dynamo keeps it (a copy of the lengths' owners)."""
    utils = _dynamo_utils()
    table = getattr(utils, "guard_failures", None) if utils is not None else None
    if not isinstance(table, dict):
        return {}
    return {code: list(reasons) for code, reasons in table.items() if isinstance(reasons, list)}


def _where(code: Any) -> str:
    name = getattr(code, "co_name", None)
    if name is None:
        return "a compiled function"
    return f"{name} ({getattr(code, 'co_filename', '?')}:{getattr(code, 'co_firstlineno', '?')})"


class RecompileCounter:
    """Graphs built after ``start()`` (step 1's end), and the guard failures that caused them.

    ``check(step)`` returns the running total and logs one warning per compiled function that recompiled since
    the previous check, with its causes.
    """

    def __init__(self) -> None:
        self.started = False
        self._graphs_at_start = 0
        self._seen: dict[Any, int] = {}  # code object -> guard failures already reported
        self.total = 0
        self.ever_compiled = False

    def start(self) -> None:
        """Step 1 is over: what was compiled until now is warm-up, every later graph counts."""
        self.started = True
        self._graphs_at_start = graphs_built()
        self.ever_compiled = self._graphs_at_start > 0
        self._seen = {code: len(reasons) for code, reasons in _failures().items()}

    def check(self, step: int) -> int:
        """Recompilations since ``start()`` (0 before it); warns once about each new one with its cause."""
        if not self.started:
            return 0
        built = graphs_built()
        self.ever_compiled = self.ever_compiled or built > 0
        new = max(built - self._graphs_at_start - self.total, 0)
        causes = self._new_causes()
        if new or causes:
            self.total += new
            for where, reasons in causes.items() or {"a compiled function": [CAUSE_UNKNOWN]}.items():
                logger.warning(
                    "torch.compile recompiled %s after step 1 (by step %d; %d recompile(s) since step 1): %s. Each "
                    "recompile pauses training for a compile; see perf/recompiles",
                    where, step, self.total, "; ".join(reasons),
                )  # fmt: skip
        return self.total

    def _new_causes(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for code, reasons in _failures().items():
            seen = self._seen.get(code, 0)
            if len(reasons) > seen:
                fresh = [str(r).split("\nUser stack trace:")[0][:MAX_CAUSE_CHARS] for r in reasons[seen:]]
                out[_where(code)] = list(dict.fromkeys(fresh)) or [CAUSE_UNKNOWN]
            self._seen[code] = len(reasons)
        return out

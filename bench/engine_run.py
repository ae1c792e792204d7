"""Submit a batch of requests to an in-process engine at once and wait for all (shared by the bench scripts)."""

from __future__ import annotations

import threading
import time
from typing import Any


def submit_and_wait(engine: Any, requests: list[Any], tag: str, timeout: float) -> tuple[int, float]:
    """Submit every ``Request`` at once, wait for all; returns (generated tokens, seconds).

    Raises:
        TimeoutError: not every request finished within ``timeout`` seconds (says how many did).
        RuntimeError: a request finished with an error (the first one is named).
    """
    done, lock, outs = threading.Event(), threading.Lock(), []

    def on_finish(out: Any) -> None:
        with lock:
            outs.append(out)
            if len(outs) == len(requests):
                done.set()

    t0 = time.perf_counter()
    for req in requests:
        engine.submit(req, on_finish)
    if not done.wait(timeout=timeout):
        raise TimeoutError(f"engine run {tag}: {len(outs)}/{len(requests)} requests finished within {timeout:.0f} s")
    seconds = time.perf_counter() - t0
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"engine run {tag}: {errors[0]}")
    return sum(len(o.token_ids) for o in outs), seconds


def synthetic_prompt(i: int, n: int, length: int) -> list[int]:
    """Token ids of request ``i`` in run ``n``: distinct across requests and runs (no prefix-cache hits), no
    tokenizer needed."""
    return [(7 * i + 3 * j + n) % 1000 + 2 for j in range(length)]

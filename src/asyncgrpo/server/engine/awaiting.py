"""Awaiting the engine's futures on the event loop: no executor thread parked on them, a logged line every 30 s.

The engine (its thread, or its process behind the pipe) answers pause, resume, cache resets and weight updates
with ``concurrent.futures.Future``; awaiting those directly saves a thread hop per call, which a weight round
pays several times on its critical path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

LOG_EVERY_S = 30.0


async def awaited(fut: concurrent.futures.Future, what: str, timeout: float | None = None) -> Any:
    """The result of ``fut`` (its error re-raised); ``TimeoutError`` naming ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    waiting = asyncio.wrap_future(fut)
    t0 = time.monotonic()
    handle: asyncio.TimerHandle | None = None

    def tick() -> None:
        nonlocal handle
        logger.info("still waiting for %s (%.0f s so far)", what, time.monotonic() - t0)
        handle = loop.call_later(LOG_EVERY_S, tick)

    handle = loop.call_later(LOG_EVERY_S, tick)
    try:
        if timeout is None:
            return await waiting
        try:
            return await asyncio.wait_for(waiting, timeout)
        except TimeoutError:
            if not fut.done():
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}") from None
            raise
    finally:
        handle.cancel()

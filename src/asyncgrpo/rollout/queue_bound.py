"""``queue_maxsize`` (TRL 1.16's field): how many scored samples may wait in the sample queue for the trainer.

``max_staleness`` already paces generation in tokens (G3); this bound counts samples, as TRL's does, and holds a
scored group back until the trainer has pulled enough. A group is never held when the queue is empty, so one larger
than the bound still goes through (alone) instead of waiting forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

POLL_S = 0.02  # how often a held group looks at the queue again


async def wait_for_queue_room(channels: Any, n: int, bound: int) -> float:
    """Wait until ``n`` more samples fit in the sample queue under ``bound`` (0: no bound); returns the seconds waited.

    Returns early when the worker is asked to stop (the trainer reads no more samples).
    """
    counter = getattr(channels, "samples_queued", None)
    if bound <= 0 or counter is None:
        return 0.0
    if not 0 < counter.value or counter.value + n <= bound:
        return 0.0
    t0 = time.monotonic()
    logged = False
    while 0 < counter.value and counter.value + n > bound and not channels.stop.is_set():
        if not logged:
            logger.info("sample queue full (%d queued, queue_maxsize=%d): holding a scored group of %d samples until "
                        "the trainer pulls", counter.value, bound, n)  # fmt: skip
            logged = True
        await asyncio.sleep(POLL_S)
    return time.monotonic() - t0

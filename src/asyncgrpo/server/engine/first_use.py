"""Capturing a CUDA graph at its first use or while the engine idles, for the decode buckets (``runner.py``) and
prefill rows (``row_prefill.py``).

A capture that fails mid-run must not stop serving: every graph is dropped and the engine runs eagerly from then
on (slower, still correct), with the error logged once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def capture_at_first_use(capture: Callable[[], None], drop_all: Callable[[], None], what: str,
                         when: str = "at first use") -> None:  # fmt: skip
    """Run ``capture``; log its milliseconds, or on any error log it and call ``drop_all``."""
    t0 = time.perf_counter()
    try:
        capture()
    except Exception:  # a capture error must leave the engine serving, eagerly
        logger.exception("capturing the %s CUDA graph failed; running it eagerly from now on", what)
        drop_all()
        return
    logger.info("captured the %s CUDA graph %s (%.0f ms)", what, when, 1000 * (time.perf_counter() - t0))

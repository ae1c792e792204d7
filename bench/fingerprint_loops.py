"""Rollout-loop subclasses of ``bench/rollout_fingerprint.py``; module-level, so the spawned worker imports them."""

from __future__ import annotations

from typing import Any

from asyncgrpo.rollout.loop import AsyncRolloutLoop


class PlainLoop(AsyncRolloutLoop):
    """The default loop (a subclass only so ``group_requests`` can be set on it per run)."""


class EveryThirdRejected(AsyncRolloutLoop):
    """Rejects rows 0, 3, 6, ... in epoch 0 and rows 1, 4, 7, ... in epoch 1 (``filter_prompt``)."""

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        return (row_index + 2 * epoch) % 3 != 0

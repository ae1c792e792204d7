"""Rank 0 tells the other trainer processes what only it knows (the step's rows, when to stop, server facts).

One process (``world_size`` 1) needs no collective: the helpers return their input. With several, every
process must call the same helper at the same point of the step (they are collectives of the default group).
"""

from __future__ import annotations

from typing import Any

import torch


def broadcast_from_zero(obj: Any, world_size: int) -> Any:
    """Rank 0's ``obj`` on every process (the other processes pass anything, e.g. None)."""
    if world_size <= 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def scatter_from_zero(per_rank: list[Any] | None, world_size: int) -> Any:
    """Process i gets ``per_rank[i]``; ``per_rank`` (one entry per process) is read on rank 0 only."""
    if world_size <= 1:
        return per_rank[0] if per_rank is not None else None
    box: list[Any] = [None]
    torch.distributed.scatter_object_list(box, per_rank, src=0)
    return box[0]

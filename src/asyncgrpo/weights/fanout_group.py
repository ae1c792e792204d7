"""Pieces of the several-server weight sync (``weights/fanout.py``): the fan-out broadcast and the join.

``FanoutGroup`` broadcasts each tensor into one group per server in turn (the ``per_server`` topology);
``join_watching`` joins a group as rank 0 while the servers' ``/init_weight_transfer_engine`` calls run.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncgrpo.errors import WeightTransferError
from asyncgrpo.weights.collectives import TransferGroup, join_group


class FanoutGroup(TransferGroup):
    """Broadcasts into each member group in turn; ``lost`` drops a member whose server died (or re-raises)."""

    def __init__(self, members: dict[str, TransferGroup], lost: Callable[[str, BaseException], None]) -> None:
        first = next(iter(members.values()))
        self.backend, self.rank, self.device = first.backend, 0, first.device
        self.world_size = 1 + sum(g.world_size - 1 for g in members.values())
        self.members, self._lost = members, lost

    def _each(self, fn: Callable[[TransferGroup], None]) -> None:
        for url, group in list(self.members.items()):
            try:
                fn(group)
            except Exception as exc:  # noqa: BLE001 - one member's backend error: _lost re-raises unless it died
                self._lost(url, exc)
                del self.members[url]

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._each(lambda g: g.broadcast(tensor, src))

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        raise NotImplementedError("the fan-out only broadcasts; each member group was warmed up when it formed")

    def synchronize(self, what: str) -> None:
        self._each(lambda g: g.synchronize(what))


def join_watching(
    futures: dict[str, concurrent.futures.Future],
    backend: str,
    world: int,
    device: torch.device,
    timeout_s: float,
    store: Any,
    uid: bytes | None,
) -> TransferGroup:
    """Join the group as rank 0 in a thread while watching each server's init call (``futures`` by URL).

    A server that rejects its ``/init_weight_transfer_engine`` ends the wait at once, named; so does the timeout.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["group"] = join_group(backend, rank=0, world_size=world, device=device,
                                      timeout_s=timeout_s, store=store, unique_id=uid)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - re-raised below in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="asyncgrpo-fanout-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s + 10
    while thread.is_alive():
        thread.join(0.05)
        for url, fut in futures.items():
            if fut.done() and fut.exception() is not None:
                raise WeightTransferError(f"{url} rejected POST /init_weight_transfer_engine: {fut.exception()}")
        if time.monotonic() > deadline:
            raise WeightTransferError(f"timed out after {timeout_s:.0f}s joining the weight-transfer group "
                                      f"of {', '.join(futures)}")  # fmt: skip
    if "error" in box:
        raise WeightTransferError(f"joining the weight-transfer group of {', '.join(futures)} failed: "
                                  f"{box['error']}") from box["error"]  # fmt: skip
    return box["group"]

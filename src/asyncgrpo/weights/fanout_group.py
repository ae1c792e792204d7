"""The group a round of the weight sender (``weights/sender.py``) broadcasts into.

``broadcast_group`` picks the group of a round and arms its abort checks; ``FanoutGroup`` broadcasts each tensor
into one group per server in turn (the ``per_server`` topology with several servers).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

from asyncgrpo.errors import WeightTransferError
from asyncgrpo.weights.collectives import TransferGroup
from asyncgrpo.weights.links import Sender


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


def _failed_check(fut: concurrent.futures.Future, what: str) -> Callable[[], None]:
    """An abort check: raise once the server's call failed (the broadcast would never end); ``what`` says so."""

    def check() -> None:
        if fut.done() and fut.exception() is not None:
            raise WeightTransferError(f"{what}: {fut.exception()}") from fut.exception()

    return check


def broadcast_group(sender: Sender, futures: dict[str, concurrent.futures.Future]) -> TransferGroup:
    """The group a round broadcasts into, its abort checks armed on the servers' ``/update_weights`` calls.

    One group (one server, or ``shared``): that group, stopped by any failed update. ``per_server`` with several:
    a :class:`FanoutGroup` whose member of a server that died is dropped (gloo), or which stops the run (NCCL: a
    collective with a dead peer cannot be abandoned). The caller clears every ``abort_check`` afterwards.
    """
    one = sender.group
    if one is not None:
        if len(futures) == 1:
            url, fut = next(iter(futures.items()))
            one.abort_check = _failed_check(fut, "the server failed POST /update_weights")
        else:
            checks = [_failed_check(f, f"POST /update_weights failed on {u}") for u, f in futures.items()]

            def any_failed() -> None:
                for check in checks:
                    check()

            one.abort_check = any_failed
        return one

    def lost(url: str, exc: BaseException) -> None:
        if sender.backend == "nccl" and sender.gone(url):  # the stream holds a collective with a dead peer
            raise WeightTransferError(f"generation server {url} died during the NCCL weight broadcast; NCCL "
                                      "cannot abandon it. Restart the servers and resume from the last "
                                      "checkpoint") from exc  # fmt: skip
        if url in sender.links and sender.policy is not None:
            sender.policy.lost(sender, sender.links[url], exc)

    members = {}
    for url, link in sender.links.items():
        assert link.group is not None
        link.group.abort_check = _failed_check(futures[url], f"POST /update_weights failed on {url}")
        members[url] = link.group
    return FanoutGroup(members, lost)

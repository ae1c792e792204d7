"""What the weight sender keeps per generation server, and how it forms a transfer group with them.

Two topologies, both speaking docs/protocol.md's ``init_info`` (so real vLLM servers join as they are):

* ``per_server`` (default): one group per server, trainer rank 0 + that server's workers (``rank_offset``
  1). Each tensor is broadcast into every group in turn: N servers cost N broadcasts of the weights.
* ``shared``: one group of ``1 + Σ server world sizes`` ranks; server k joins at ``rank_offset`` 1 + the
  world sizes of the servers before it. Each tensor is broadcast once to all (NCCL pipelines it).

With one server both are the same group.
"""

from __future__ import annotations

import base64
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

import torch

from asyncgrpo.errors import ServerError, WeightTransferError
from asyncgrpo.weights import nccl_lib
from asyncgrpo.weights.base import ServerControl
from asyncgrpo.weights.collectives import TensorMeta, TransferGroup, join_group, make_store
from asyncgrpo.weights.loop_thread import LoopThread, local_address_towards
from asyncgrpo.weights.name_check import ServerWeights

logger = logging.getLogger(__name__)

TOPOLOGIES = ("per_server", "shared")
_T = TypeVar("_T")


class ServerLink:
    """One server of the sender: its client (on the sender's loop), size, group and last round's metadata."""

    def __init__(self, client: ServerControl, world_size: int, index: int) -> None:
        self.client, self.world_size, self.index = client, world_size, index
        self.group: TransferGroup | None = None  # per_server topology
        self.last_metas: list[TensorMeta] | None = None
        self.weights: ServerWeights | None = None  # its checkpoint's names and shapes (checked before broadcasting)
        self.reuse_metadata = True  # it takes empty update_info lists as the last round's (vLLM >= 0.33)

    @property
    def url(self) -> str:
        return self.client.base_url


class Sender(Protocol):
    """What the round, the groups and the lost-server policies use of ``weights.sender.WeightSender`` (named here,
    not imported: that module imports them)."""

    links: dict[str, ServerLink]
    pushed: dict[str, str]
    policy: Any  # weights.lost_server.LostServerPolicy
    backend: str | None
    shared: TransferGroup | None
    timeout_s: float
    packed: bool
    packed_buffer_size_bytes: int
    packed_num_buffers: int
    profile: bool
    restarts: int
    last_breakdown: dict[str, Any]
    _loop: LoopThread | None
    _lanes: Any
    _ipc: Any
    _server_profiles: bool | None

    @property
    def group(self) -> TransferGroup | None: ...

    def _http(self, coro: Coroutine[Any, Any, _T], what: str) -> _T: ...

    def _loop_run(self, coro: Coroutine[Any, Any, _T], timeout: float, what: str) -> _T: ...

    def _each(self, make: Callable[[ServerControl], Coroutine[Any, Any, Any]], what: str) -> None: ...

    def _abandon(self, futures: dict[str, concurrent.futures.Future]) -> list[str]: ...

    def gone(self, url: str) -> bool: ...

    def drop(self, url: str, reason: str) -> None: ...

    def reform(self) -> None: ...

    def reform_shared(self) -> None: ...


def resolve_device(device: torch.device | str | None) -> torch.device:
    """Where rank 0's tensors go: ``device``, else cuda/cpu; a bare ``cuda`` gets the current index."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def form_group(
    links: Sequence[ServerLink],
    loop: LoopThread,
    *,
    backend: str,
    device: torch.device,
    packed: bool,
    buffer_bytes: int,
    num_buffers: int,
    timeout_s: float,
    master_address: str | None = None,
) -> TransferGroup:
    """One group of rank 0 and ``links``' workers: post every init from the loop thread while joining.

    Raises:
        WeightTransferError: a server rejected its init or the rendezvous timed out (named by URL).
    """
    world = 1 + sum(link.world_size for link in links)
    base: dict[str, Any] = {"world_size": world, "packed": packed, "packed_buffer_size_bytes": buffer_bytes,
                            "packed_num_buffers": num_buffers}  # fmt: skip
    store = unique_id = None
    if backend == "nccl":
        unique_id = nccl_lib.unique_id()
        base["nccl_unique_id_b64"] = base64.b64encode(unique_id).decode("ascii")
    else:
        address = master_address or local_address_towards(links[0].url)
        store = make_store(address, 0, rank=0, world_size=world, timeout_s=timeout_s)
        base.update(master_address=address, master_port=int(store.port))
    futures, offset = {}, 1
    for link in links:
        info = {**base, "rank_offset": offset}
        offset += link.world_size
        futures[link.url] = loop.submit(link.client.init_weight_transfer_engine(info, timeout=timeout_s))
    group = join_watching(futures, backend, world, device, timeout_s, store, unique_id)
    wait_all(futures, "POST /init_weight_transfer_engine", timeout_s, None)
    logger.info("weight transfer to %s ready (%s, world size %d)", ", ".join(futures), backend, world)
    return group


def wait_all(
    futures: dict[str, concurrent.futures.Future],
    what: str,
    timeout_s: float,
    lost: Callable[[str, BaseException], None] | None,
) -> None:
    """Wait for one step on every server (``futures`` by URL), all within one ``timeout_s``.

    A failure goes to ``lost(url, error)`` (which drops the server or raises); without ``lost`` it fails naming the
    server. A step still running when time is up stays running (the server may be inside a collective).
    """
    deadline = time.monotonic() + timeout_s
    for url, fut in futures.items():
        try:
            fut.result(max(deadline - time.monotonic(), 0.0))
        except concurrent.futures.TimeoutError:
            err = WeightTransferError(f"{url}: timed out after {timeout_s:.0f}s waiting for {what}")
            if lost is None:
                raise err from None
            lost(url, err)
        except (ServerError, OSError) as exc:
            if lost is None:
                raise WeightTransferError(f"{what} failed on {url}: {exc}") from exc
            lost(url, exc)


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

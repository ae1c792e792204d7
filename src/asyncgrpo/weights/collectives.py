"""The weight-transfer collective group, shared by the trainer (sender) and the server (receiver).

One group holds trainer rank 0 and every server worker (docs/protocol.md, weight
transfer). Two backends, neither touching torch.distributed's global default group
(so a trainer process keeps its own group for FSDP):

* ``nccl``: a raw communicator (``nccl_lib``: ncclCommInitRank via ctypes) over a 128-byte
  unique id (minted by rank 0 and sent base64 in ``init_info``, or exchanged through
  a TCPStore when ``master_address``/``master_port`` are given).
* ``gloo``: ``ProcessGroupGloo`` over a ``TCPStore`` whose master is rank 0 (CPU runs).

The wire format (which broadcasts, in which order, of which bytes) is defined once, in
``weights/wire.py``: ``send_tensors`` and ``receive_tensors`` there are mirror images.
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from asyncgrpo.errors import WeightTransferError
from asyncgrpo.weights import nccl_lib

logger = logging.getLogger(__name__)

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # vLLM's default: 1 GiB per packed chunk (a receiver's fallback)
# What our sender asks for in init_info: chunks small enough that packing the first and unpacking the last (the
# pipeline's fill and drain, not hidden behind a broadcast) cost little, large enough that the per-broadcast
# overhead stays small; the buffers on each end shrink from 2 GiB to 512 MiB.
DEFAULT_SENDER_BUCKET_BYTES = 256 << 20
DEFAULT_PACKED_NUM_BUFFERS = 2
_NCCL_MAX_COUNT = 2**31 - 1  # keep element counts in int range (older NCCL builds)
_STORE_UID_KEY = "asyncgrpo/nccl_unique_id"
_T = TypeVar("_T")


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype and shape of one tensor of an update round (the ``update_info`` lists)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """torch attribute name of a dtype (``torch.bfloat16`` -> ``"bfloat16"``), as ``dtype_names`` carries it."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype name {name!r} is not a torch dtype; use names like 'bfloat16', 'float32'")  # noqa: TRY004
    return dtype


def plan_chunks(metas: list[TensorMeta], buffer_size_bytes: int) -> list[list[int]]:
    """Split tensor indices into packed chunks.

    A chunk closes right after the tensor that takes its byte total over
    ``buffer_size_bytes`` (so a chunk may exceed it by one tensor); the last chunk
    takes the rest. Each chunk travels as one uint8 broadcast.
    """
    if buffer_size_bytes <= 0:
        raise ValueError(f"packed_buffer_size_bytes must be > 0, got {buffer_size_bytes}")
    chunks: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, meta in enumerate(metas):
        current.append(i)
        total += meta.nbytes
        if total > buffer_size_bytes:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


def call_with_timeout(fn: Callable[[], _T], timeout_s: float, what: str) -> _T:
    """Run a blocking call (a rendezvous) in a daemon thread and give up after ``timeout_s``.

    On timeout the thread is left behind (a C++ rendezvous cannot be interrupted) and
    :class:`WeightTransferError` names ``what`` was waited for.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"asyncgrpo-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise WeightTransferError(f"timed out after {timeout_s:.0f}s waiting for {what}")
    if "error" in box:
        raise WeightTransferError(f"{what} failed: {box['error']}") from box["error"]
    return box["value"]


class TransferGroup(ABC):
    """A broadcast group between the trainer (rank 0) and the server workers."""

    backend: str
    rank: int
    world_size: int
    device: torch.device  # where tensors must live for this group's collectives
    # Polled while waiting on a collective; raises to abandon the wait (e.g. the server rejected the round).
    abort_check: Callable[[], None] | None = None

    def _poll_abort(self) -> None:
        if self.abort_check is not None:
            self.abort_check()

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` in place from ``src`` (contiguous, on ``self.device``)."""

    @abstractmethod
    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over all ranks."""

    def synchronize(self, what: str) -> None:
        """Wait until every collective issued so far has finished (bounded by the group timeout)."""

    def close(self) -> None:
        """Drop the communicator."""

    def abandon(self, reason: str) -> None:
        """Give the group up while a round may still wait on a peer that is gone (another trainer formed a new
        group): every wait on it raises ``reason`` at its next poll, and the communicator is released without
        waiting for the stuck collective (gloo does not always notice a killed peer; NCCL never does)."""

        def stop() -> None:
            raise WeightTransferError(reason)

        self.abort_check = stop
        self._release_stuck()

    def _release_stuck(self) -> None:
        self.close()


class GlooGroup(TransferGroup):
    """``ProcessGroupGloo`` on a TCPStore; CPU tensors; every collective waits with the group timeout."""

    backend = "gloo"

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float) -> None:
        import torch.distributed as dist

        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        self._store = store  # keep the TCPStore master alive as long as the group
        self._timeout = datetime.timedelta(seconds=timeout_s)
        prefixed = dist.PrefixStore("asyncgrpo_weight_transfer", store)
        self._pg = dist.ProcessGroupGloo(prefixed, rank, world_size, self._timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        import torch.distributed as dist

        if tensor.numel() == 0:
            # NCCL treats a zero-count broadcast as a no-op (vLLM issues them for empty chunks); gloo would
            # still exchange a message, so skip it on every rank to keep the two backends' wire alike.
            return
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        # Bytes on the wire: gloo then needs no support for the tensor's dtype (bf16, bool, ...).
        wire = tensor.reshape(-1).view(torch.uint8)
        self._wait(self._pg.broadcast([wire], opts))

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self._wait(self._pg.allreduce([tensor]))

    def _wait(self, work: Any) -> None:
        # gloo runs the collective on its own threads; poll so abort_check can cut the wait short. A peer killed
        # mid-round can leave the work pending with no error, so the group timeout bounds the wait here too.
        start = time.monotonic()
        deadline, next_log = start + self._timeout.total_seconds(), start + 30.0
        delay = 0.0
        while not work.is_completed():
            self._poll_abort()
            now = time.monotonic()
            if now > deadline:
                raise WeightTransferError(
                    f"a gloo collective did not finish within {self._timeout.total_seconds():.0f}s; a peer is gone"
                )
            if now > next_log:
                logger.info("still waiting for a gloo weight-transfer collective (%.0fs so far)", now - start)
                next_log = now + 30.0
            time.sleep(delay)
            delay = min(0.005, delay + 0.0002)
        work.wait(self._timeout)

    def close(self) -> None:
        self._pg = None
        self._store = None

    def _release_stuck(self) -> None:
        # Dropping a process group joins its worker threads, which wait for the pending collective (up to the
        # group timeout): let a daemon thread hold the last reference instead of the caller.
        held = [self._pg, self._store]
        self._pg = self._store = None
        threading.Thread(target=held.clear, name="asyncgrpo-gloo-release", daemon=True).start()
        del held


# dtypes NCCL moves natively; others travel as their bytes (uint8).
_NCCL_NATIVE = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
                torch.uint8, torch.bool}  # fmt: skip


def _nccl_wire(tensor: torch.Tensor) -> torch.Tensor:
    """A flat view whose element count fits NCCL's int count (wider dtype for huge uint8 chunks).

    Broadcast only copies bytes, so a view as int32/int64 moves exactly the same bytes.
    """
    flat = tensor.reshape(-1)
    if flat.dtype not in _NCCL_NATIVE:
        flat = flat.view(torch.uint8)
    if flat.numel() <= _NCCL_MAX_COUNT:
        return flat
    raw = flat.view(torch.uint8)
    for wide in (torch.int32, torch.int64):
        if raw.numel() % wide.itemsize == 0 and raw.numel() // wide.itemsize <= _NCCL_MAX_COUNT:
            return raw.view(wide)
    raise WeightTransferError(
        f"a broadcast of {raw.numel()} bytes does not fit NCCL's element count; lower packed_buffer_size_bytes"
    )


class NcclGroup(TransferGroup):
    """A raw NCCL communicator (``nccl_lib``, ctypes over torch's NCCL) on one CUDA device.

    NCCL calls are asynchronous on the current stream; :meth:`synchronize` polls a
    CUDA event so a dead peer turns into a timeout instead of a hang.
    """

    backend = "nccl"

    def __init__(self, comm: Any, rank: int, world_size: int, device: torch.device, timeout_s: float) -> None:
        self._comm = comm
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout_s = timeout_s

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        with torch.cuda.device(self.device):
            self._comm.broadcast(_nccl_wire(tensor), root=src)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        with torch.cuda.device(self.device):
            self._comm.all_reduce_sum(tensor)

    def synchronize(self, what: str) -> None:
        with torch.cuda.device(self.device):
            event = torch.cuda.Event()
            event.record()
        start = time.monotonic()
        deadline, next_log, delay = start + self.timeout_s, start + 30.0, 0.0
        while not event.query():  # CPU-GPU sync point, polled so it can time out
            self._poll_abort()
            now = time.monotonic()
            if now > deadline:
                raise WeightTransferError(
                    f"timed out after {self.timeout_s:.0f}s waiting for {what} (NCCL); a peer is gone or stuck"
                )
            if now > next_log:
                logger.info("still waiting for %s (NCCL, %.0fs so far)", what, now - start)
                next_log = now + 30.0
            # The end of a weight round is on its critical path: poll finely (50 us), which costs nothing next to
            # a round of milliseconds; a 1 ms sleep added half a millisecond on each end on average.
            time.sleep(delay)
            delay = min(5e-5, delay + 1e-5)

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
        self._comm = None

    def _release_stuck(self) -> None:
        # ncclCommDestroy would wait for the stuck broadcast; ncclCommAbort ends it (off the caller's thread).
        comm, self._comm = self._comm, None
        if comm is not None:
            threading.Thread(target=comm.abort, name="asyncgrpo-nccl-abort", daemon=True).start()


def make_store(master_address: str, master_port: int, *, rank: int, world_size: int, timeout_s: float) -> Any:
    """TCPStore for the rendezvous: rank 0 is the master (``master_port`` 0 picks a free port)."""
    import torch.distributed as dist

    return dist.TCPStore(
        master_address,
        master_port,
        world_size,
        rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_group(
    backend: str,
    *,
    rank: int,
    world_size: int,
    device: torch.device | str,
    timeout_s: float,
    store: Any = None,
    unique_id: bytes | None = None,
) -> TransferGroup:
    """Join the weight-transfer group (blocks until every rank joined), then warm it up.

    ``nccl`` needs ``unique_id`` or ``store`` (rank 0 publishes a fresh id there);
    ``gloo`` needs ``store``. Then :func:`warm_up`, the one-element all-reduce the
    protocol requires before any other collective (its sum is never checked).

    Raises:
        WeightTransferError: the rendezvous failed or timed out.
    """
    if backend == "gloo":
        if store is None:
            raise ValueError("the gloo weight-transfer backend needs master_address and master_port")
        group: TransferGroup = call_with_timeout(
            lambda: GlooGroup(store, rank, world_size, timeout_s), timeout_s + 5, "the gloo weight-transfer rendezvous"
        )
    elif backend == "nccl":
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"the nccl weight-transfer backend needs a CUDA device, got {dev}; use gloo on CPU")
        if unique_id is None:
            if store is None:
                raise ValueError("the nccl weight-transfer backend needs nccl_unique_id_b64 or master_address/port")
            if rank == 0:
                unique_id = nccl_lib.unique_id()
                store.set(_STORE_UID_KEY, unique_id)
            else:
                unique_id = call_with_timeout(lambda: store.get(_STORE_UID_KEY), timeout_s, "the NCCL id in the store")

        def init() -> Any:
            return nccl_lib.Communicator(world_size, bytes(unique_id), rank, dev)

        comm = call_with_timeout(init, timeout_s, f"the NCCL rendezvous of {world_size} ranks")
        group = NcclGroup(comm, rank, world_size, dev, timeout_s)
    else:
        raise ValueError(f"weight-transfer backend {backend!r} is not one of 'nccl', 'gloo'")
    warm_up(group)
    logger.info("joined the %s weight-transfer group as rank %d of %d", backend, rank, world_size)
    return group


def warm_up(group: TransferGroup) -> float:
    """The one-element float32 sum all-reduce every rank joins before any other collective.

    Every rank contributes ``0.0``, as vLLM's workers do (``torch.zeros(1)`` in its
    PyNccl communicator), so the sum carries no information: it is returned for
    tests but never checked (a peer is free to send anything).
    """
    probe = torch.zeros(1, dtype=torch.float32, device=group.device)
    group.all_reduce_sum(probe)
    group.synchronize("the warm-up all-reduce")
    return float(probe.item())

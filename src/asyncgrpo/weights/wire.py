"""The bytes of one weight round: which broadcasts, in which order, and how they avoid staging copies.

Wire format (vLLM's, unchanged): unpacked, one broadcast per tensor in its dtype; packed, the tensors
are grouped into chunks by :func:`~asyncgrpo.weights.collectives.plan_chunks` and each chunk travels as one
uint8 broadcast of the tensors' bytes back to back.

What this module adds, with the same bytes on the wire:

- a tensor that travels alone (unpacked, or a chunk of one) is broadcast from where it lies on the sender
  and, when the receiver names its destination (a server parameter of the same dtype, shape and device),
  straight into that storage: no staging buffer and no copy on either end;
- with NCCL on CUDA and ``num_buffers >= 2`` the chunks are double-buffered: broadcasts run on a side
  stream while the current stream packs the next chunk (sender) or copies the previous one out (receiver),
  so the copies overlap the transfer instead of adding to it.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import torch

from asyncgrpo.client.errors import WeightTransferError
from asyncgrpo.weights.collectives import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    TensorMeta,
    TransferGroup,
    plan_chunks,
)

Destination = Callable[[TensorMeta], "torch.Tensor | None"]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: the bytes a packed chunk holding only it carries."""
    return t.detach().reshape(-1).view(torch.uint8)


def _in_place_target(destination: Destination | None, meta: TensorMeta, device: torch.device) -> torch.Tensor | None:
    """The tensor to receive ``meta`` straight into, when the caller has one that matches it exactly."""
    dst = destination(meta) if destination is not None else None
    if dst is None or dst.device != device or dst.dtype != meta.dtype or tuple(dst.shape) != meta.shape:
        return None
    return dst.detach() if dst.is_contiguous() else None


def unpack(buf: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """Views into a received uint8 chunk; a tensor whose offset is misaligned for its dtype is copied."""
    out = []
    offset = 0
    for meta in metas:
        raw = buf[offset : offset + meta.nbytes]
        if offset % meta.dtype.itemsize:
            raw = raw.clone()
        out.append((meta.name, raw.view(meta.dtype).view(meta.shape)))
        offset += meta.nbytes
    return out


class _Lanes:
    """The broadcast stream and the chunk buffers of one round (a plain single-stream loop off CUDA)."""

    def __init__(self, group: TransferGroup, num_buffers: int, chunk_bytes: list[int], buffer_size: int = 0) -> None:
        dev = group.device
        self.device = dev
        self.overlap = dev.type == "cuda" and group.backend == "nccl" and num_buffers >= 2
        self.main = torch.cuda.current_stream(dev) if self.overlap else None
        self.comm = torch.cuda.Stream(dev) if self.overlap else None
        self.n = max(1, min(num_buffers, len(chunk_bytes))) if self.overlap else 1
        self.size = max(chunk_bytes, default=0)
        self.bufs: list[torch.Tensor | None] = [None] * self.n
        self.freed: list[torch.cuda.Event | None] = [None] * self.n
        self.group = group
        self.in_flight: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()  # lone tensors being sent
        self.max_in_flight_bytes = max(1, num_buffers) * buffer_size
        self.in_flight_bytes = 0
        if self.overlap:  # the round starts after everything queued before it (the optimizer step, a forward)
            self.comm.wait_stream(self.main)

    def buffer(self, k: int, nbytes: int) -> torch.Tensor:
        """Buffer of chunk ``k`` (its previous user finished, in stream order), ``nbytes`` long."""
        i = k % self.n
        if not self.overlap:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.bufs[i] is None:
            self.bufs[i] = torch.empty(self.size, dtype=torch.uint8, device=self.device)
            # fresh memory may be a block the current stream still uses: the side stream starts after that
            self.comm.wait_stream(self.main)
        return self.bufs[i][:nbytes]

    def on_comm(self, after_main: bool):
        """Run the enclosed broadcast on the side stream (``after_main``: after what the current stream queued:
        the sender's packing or gathering of what it sends)."""
        if not self.overlap:
            return contextlib.nullcontext()
        if after_main:
            self.comm.wait_stream(self.main)
        return torch.cuda.stream(self.comm)

    def mark(self, stream_is_comm: bool) -> torch.cuda.Event | None:
        if not self.overlap:
            return None
        ev = torch.cuda.Event()
        ev.record(self.comm if stream_is_comm else self.main)
        return ev

    def hold(self, t: torch.Tensor) -> None:
        """Keep ``t`` (read by the side stream) until its broadcast is done. Tensors in flight are bounded by
        ``num_buffers`` x the packed buffer size in bytes (and one tensor), so a lazy source (FSDP gathers, merged
        LoRA weights) holds as much as the packed chunks would, while small tensors never wait."""
        if not self.overlap:
            return
        self.in_flight.append((self.mark(stream_is_comm=True), t))
        self.in_flight_bytes += t.numel() * t.element_size()
        while len(self.in_flight) > 1 and self.in_flight_bytes > self.max_in_flight_bytes:
            event, done = self.in_flight.popleft()
            self._wait(event, "a weight broadcast to finish before making the next tensor")
            self.in_flight_bytes -= done.numel() * done.element_size()

    def _wait(self, event: torch.cuda.Event, what: str) -> None:
        timeout = float(getattr(self.group, "timeout_s", 600.0))
        deadline = time.monotonic() + timeout
        while not event.query():  # polled (not event.synchronize()) so a dead peer becomes a timeout
            self.group._poll_abort()
            if time.monotonic() > deadline:
                raise WeightTransferError(f"timed out after {timeout:.0f}s waiting for {what} (NCCL)")
            time.sleep(0.0002)

    def finish(self) -> None:
        """Everything broadcast is ordered before what the current stream does next (e.g. a synchronise)."""
        if self.overlap:
            self.main.wait_stream(self.comm)
            self.in_flight.clear()  # ordered: their memory is reused on the current stream only after that
            self.in_flight_bytes = 0


def send_tensors(
    group: TransferGroup,
    tensors: Iterable[torch.Tensor],
    metas: list[TensorMeta],
    *,
    packed: bool,
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
) -> None:
    """Rank 0: broadcast ``tensors`` (in ``metas`` order) unpacked or in packed uint8 chunks.

    Each tensor is taken from ``tensors`` only when it is sent or packed, and dropped after, so a lazy source
    (gathered or merged tensors) costs at most ``num_buffers`` tensors in flight plus ``num_buffers`` chunks
    (``num_buffers=1``: one tensor and one chunk, no overlap).
    """
    it = iter(tensors)

    def next_tensor(meta: TensorMeta) -> torch.Tensor:
        try:
            t = next(it)
        except StopIteration:
            raise WeightTransferError(f"the tensors ran out before {meta.name!r}") from None
        if t.dtype != meta.dtype or tuple(t.shape) != meta.shape:
            raise WeightTransferError(
                f"tensor {meta.name!r} is {t.dtype} {tuple(t.shape)} but the update announced {meta.dtype} {meta.shape}"
            )
        return t.detach().to(group.device).contiguous()

    chunks = [[i] for i in range(len(metas))] if not packed else plan_chunks(metas, buffer_size_bytes)
    multi = [sum(metas[i].nbytes for i in c) for c in chunks if len(c) > 1]
    lanes = _Lanes(group, num_buffers, multi, buffer_size_bytes)
    k = 0
    for chunk in chunks:
        if len(chunk) == 1:  # travels alone: broadcast the tensor's own storage
            t = next_tensor(metas[chunk[0]])
            if t.numel():
                with lanes.on_comm(after_main=True):
                    group.broadcast(_as_bytes(t) if packed else t, src=0)
                lanes.hold(t)
            del t
            continue
        nbytes = sum(metas[i].nbytes for i in chunk)
        buf = lanes.buffer(k, nbytes)
        if lanes.freed[k % lanes.n] is not None:
            lanes.main.wait_event(lanes.freed[k % lanes.n])  # its previous broadcast is done
        offset = 0
        for i in chunk:
            t = next_tensor(metas[i])
            buf[offset : offset + metas[i].nbytes].copy_(_as_bytes(t))
            offset += metas[i].nbytes
            del t
        if nbytes:
            with lanes.on_comm(after_main=True):
                group.broadcast(buf, src=0)
            lanes.freed[k % lanes.n] = lanes.mark(stream_is_comm=True)
        k += 1
        del buf
    lanes.finish()


def receive_tensors(
    group: TransferGroup,
    metas: list[TensorMeta],
    *,
    packed: bool,
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    destination: Destination | None = None,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receivers: yield the tensors of a round in batches (one per tensor, or one per packed chunk).

    The caller copies each batch out (on the current stream) before asking for the next. ``destination``
    may name, per tensor, where it finally goes: a tensor that travels alone is then received straight into
    it and the batch yields that very tensor (the caller can skip copying it onto itself). With overlap on,
    the next chunk is already being received while the caller copies this one.
    """
    chunks = [[i] for i in range(len(metas))] if not packed else plan_chunks(metas, buffer_size_bytes)
    multi = [sum(metas[i].nbytes for i in c) for c in chunks if len(c) > 1]
    lanes = _Lanes(group, num_buffers, multi)
    k = 0
    for chunk in chunks:
        chunk_metas = [metas[i] for i in chunk]
        if len(chunk) == 1:
            meta = chunk_metas[0]
            t = _in_place_target(destination, meta, group.device)
            fresh = t is None
            if fresh:
                t = torch.empty(meta.shape, dtype=meta.dtype, device=group.device)
            if t.numel():
                with lanes.on_comm(after_main=fresh):  # fresh memory: after the current stream's last use of it
                    group.broadcast(_as_bytes(t) if packed else t, src=0)
                if lanes.overlap:  # the caller's copy (and any reuse of t's memory) comes after the receive
                    lanes.main.wait_event(lanes.mark(stream_is_comm=True))
            yield [(meta.name, t)]
            continue
        nbytes = sum(m.nbytes for m in chunk_metas)
        buf = lanes.buffer(k, nbytes)
        if nbytes:
            with lanes.on_comm(after_main=False):
                if lanes.freed[k % lanes.n] is not None:
                    lanes.comm.wait_event(lanes.freed[k % lanes.n])  # the caller copied its last chunk out
                group.broadcast(buf, src=0)
            if lanes.overlap:
                lanes.main.wait_event(lanes.mark(stream_is_comm=True))
        yield unpack(buf, chunk_metas)
        lanes.freed[k % lanes.n] = lanes.mark(stream_is_comm=False)  # after the caller's copies
        k += 1
        del buf
    lanes.finish()

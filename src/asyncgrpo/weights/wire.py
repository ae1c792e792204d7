"""The bytes of one weight round: which broadcasts, in which order, and how they avoid staging copies.

Wire format (vLLM's, unchanged): unpacked, one broadcast per tensor in its dtype; packed, the tensors
are grouped into chunks by :func:`~asyncgrpo.weights.collectives.plan_chunks` and each chunk travels as one
uint8 broadcast of the tensors' bytes back to back.

What this module adds, with the same bytes on the wire:

- a tensor that travels alone (unpacked, or a chunk of one) is broadcast from where it lies on the sender
  and, when the receiver names its destination (a server parameter of the same dtype, shape and device),
  straight into that storage: no staging buffer and no copy on either end;
- with NCCL on CUDA and ``num_buffers >= 2`` the chunks are pipelined: broadcasts run on a side stream
  while the current stream packs the next chunk (sender) or copies the previous one out (receiver), so the
  copies overlap the transfer instead of adding to it;
- :class:`Lanes` keeps that stream, the chunk buffers and the byte views into them from round to round:
  after the first round a sync allocates nothing and builds no per-tensor views of its buffers, and the
  sender packs a chunk with a few multi-tensor copies rather than one launch per tensor.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

import torch

from asyncgrpo.errors import WeightTransferError
from asyncgrpo.weights.collectives import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    TensorMeta,
    TransferGroup,
    plan_chunks,
)
from asyncgrpo.weights.wire_profile import WireProfile

Destination = Callable[[TensorMeta], "torch.Tensor | None"]
# The sender packs a chunk in multi-tensor copies of at most this many source bytes held at once: a lazy source
# (FSDP gathers, merged LoRA weights) then holds this much beyond the chunk buffer, and a copy launch serves many
# small tensors. Off CUDA every tensor is copied as it comes (no launches to save).
PACK_BATCH_BYTES = 32 << 20
BIG_COPY_BYTES = 1 << 20  # from this size a copy is bandwidth-bound: no gain in batching its launch


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor: the bytes a packed chunk holding only it carries."""
    return t.detach().reshape(-1).view(torch.uint8)


def _in_place_target(destination: Destination | None, meta: TensorMeta, device: torch.device) -> torch.Tensor | None:
    """The tensor to receive ``meta`` straight into, when the caller has one that matches it exactly."""
    dst = destination(meta) if destination is not None else None
    if dst is None or dst.device != device or dst.dtype != meta.dtype or tuple(dst.shape) != meta.shape:
        return None
    return dst.detach() if dst.is_contiguous() else None


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair: a large tensor in its own copy (a device memcpy at full bandwidth), the
    small ones (norms, biases: launch-bound) together in one multi-tensor launch where torch has one."""
    small_d, small_s = [], []
    for d, s in zip(dsts, srcs):
        if d.numel() * d.element_size() >= BIG_COPY_BYTES:
            d.copy_(s)
        else:
            small_d.append(d)
            small_s.append(s)
    if len(small_d) > 1:
        try:
            torch._foreach_copy_(small_d, small_s)
            return
        except (AttributeError, RuntimeError, TypeError):  # older torch, or pairs the fused path refuses
            pass
    for d, s in zip(small_d, small_s):
        d.copy_(s)


class Lanes:
    """One end's broadcast stream and chunk buffers, kept across rounds (a plain single-stream loop off CUDA).

    Args:
        group: the transfer group (its device and backend decide whether to pipeline).
        num_buffers: chunk buffers in rotation (vLLM's ``packed_num_buffers``); >= 2 pipelines on CUDA+NCCL.
    """

    def __init__(self, group: TransferGroup, num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS) -> None:
        dev = group.device
        self.device, self.group = dev, group
        self.overlap = dev.type == "cuda" and group.backend == "nccl" and num_buffers >= 2
        self.comm = torch.cuda.Stream(dev) if self.overlap else None
        self.main: torch.cuda.Stream | None = None
        self.n = num_buffers if self.overlap else 1
        self.size = 0
        self.bufs: list[torch.Tensor | None] = [None] * self.n
        self.freed: list[torch.cuda.Event | None] = [None] * self.n
        self.in_flight: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()  # lone tensors being sent
        self.in_flight_bytes = 0
        self.max_in_flight_bytes = 1
        self.profile: WireProfile | None = None
        self._plan_key: tuple | None = None
        self._plan_metas: list[TensorMeta] = []
        self._chunks: list[list[int]] = []
        self._views: dict[int, tuple[int, int, list]] = {}  # chunk -> (buffer address, bytes, views or slices)

    def plan(self, metas: list[TensorMeta], packed: bool, buffer_size_bytes: int) -> list[list[int]]:
        """The chunks of a round (kept while the metadata and packing stay the same, as they do sync to sync)."""
        key = (packed, buffer_size_bytes, len(metas))
        if key != self._plan_key or (metas is not self._plan_metas and metas != self._plan_metas):
            self._chunks = [[i] for i in range(len(metas))] if not packed else plan_chunks(metas, buffer_size_bytes)
            self._plan_key, self._plan_metas, self._views = key, metas, {}  # callers do not change a round's list
            multi = [sum(metas[i].nbytes for i in c) for c in self._chunks if len(c) > 1]
            self.size = max(self.size, max(multi, default=0))
        return self._chunks

    def begin(self, buffer_size_bytes: int, profile: WireProfile | None) -> None:
        """Start a round: it runs after everything queued on the current stream (the optimizer step, a forward)."""
        self.max_in_flight_bytes = max(1, self.n) * buffer_size_bytes
        self.profile = profile
        if self.overlap:
            self.main = torch.cuda.current_stream(self.device)
            self.comm.wait_stream(self.main)
        if profile is not None:
            profile.begin()

    def buffer(self, slot: int) -> torch.Tensor:
        """Chunk buffer ``slot`` (allocated on first use, or grown when a chunk outgrows it)."""
        buf = self.bufs[slot]
        if buf is None or buf.numel() < self.size:
            self.bufs[slot] = None
            buf = self.bufs[slot] = torch.empty(self.size, dtype=torch.uint8, device=self.device)
            if self.overlap:  # fresh memory may be a block the current stream still uses: the side stream waits
                self.comm.wait_stream(self.main)
        return buf

    def _cached(self, k: int, chunk: list[int], metas: list[TensorMeta], typed: bool) -> tuple[int, list]:
        """``(nbytes, pieces)`` of the ``k``-th packed chunk in its buffer: typed views of its tensors (receiver) or
        uint8 slices (sender); kept across rounds while the buffer stays (a misaligned tensor is a fresh copy)."""
        buf = self.buffer(k % self.n)
        cached = self._views.get(k)
        if cached is not None and cached[0] == buf.data_ptr():
            return cached[1], cached[2]
        nbytes, offset, pieces, aligned = sum(metas[i].nbytes for i in chunk), 0, [], True
        for i in chunk:
            meta = metas[i]
            raw = buf[offset : offset + meta.nbytes]
            if typed:
                aligned = aligned and offset % meta.dtype.itemsize == 0
                raw = raw if offset % meta.dtype.itemsize == 0 else raw.clone()
                pieces.append((meta.name, raw.view(meta.dtype).view(meta.shape)))
            else:
                pieces.append(raw)
            offset += meta.nbytes
        if aligned:
            self._views[k] = (buf.data_ptr(), nbytes, pieces)
        return nbytes, pieces

    def views(self, k: int, chunk: list[int], metas: list[TensorMeta]) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Receiver: the tensors of the ``k``-th chunk as views of its buffer (call after its broadcast)."""
        return self._cached(k, chunk, metas, typed=True)

    def slices(self, k: int, chunk: list[int], metas: list[TensorMeta]) -> tuple[int, list[torch.Tensor]]:
        """Sender: where each tensor of the ``k``-th chunk goes in its buffer, as uint8 slices."""
        return self._cached(k, chunk, metas, typed=False)

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

    def timed(self, kind: str, on_comm: bool):
        """Profile span ``kind`` around the enclosed work (nothing when not profiling)."""
        if self.profile is None:
            return contextlib.nullcontext()
        return _Span(self.profile, kind, self.comm if on_comm and self.overlap else self.main)

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
        if self.profile is not None:
            self.profile.end()


class _Span:
    def __init__(self, profile: WireProfile, kind: str, stream: torch.cuda.Stream | None) -> None:
        self.profile, self.kind, self.stream = profile, kind, stream

    def __enter__(self) -> None:
        self.start = self.profile.mark(self.stream)

    def __exit__(self, *exc: object) -> None:
        self.profile.add(self.kind, self.start, self.profile.mark(self.stream))


def take_announced(it: Iterator[torch.Tensor], meta: TensorMeta, device: torch.device) -> torch.Tensor:
    """The next tensor of a round, checked against the metadata announced for it, contiguous on ``device``."""
    try:
        t = next(it)
    except StopIteration:
        raise WeightTransferError(f"the tensors ran out before {meta.name!r}") from None
    if t.dtype != meta.dtype or tuple(t.shape) != meta.shape:
        raise WeightTransferError(
            f"tensor {meta.name!r} is {t.dtype} {tuple(t.shape)} but the update announced {meta.dtype} {meta.shape}"
        )
    return t.detach().to(device).contiguous()


def send_tensors(
    group: TransferGroup,
    tensors: Iterable[torch.Tensor],
    metas: list[TensorMeta],
    *,
    packed: bool,
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    lanes: Lanes | None = None,
    profile: WireProfile | None = None,
) -> None:
    """Rank 0: broadcast ``tensors`` (in ``metas`` order) unpacked or in packed uint8 chunks.

    Each tensor is taken from ``tensors`` only when it is sent or packed, and dropped after, so a lazy source
    (gathered or merged tensors) costs at most ``num_buffers`` tensors in flight plus ``num_buffers`` chunks
    (``num_buffers=1``: one tensor and one chunk, no overlap) plus ``PACK_BATCH_BYTES`` waiting to be packed.
    ``lanes`` (kept by the caller from round to round) saves the buffers' allocation and views; ``profile``
    collects the round's timeline.
    """
    it = iter(tensors)

    def next_tensor(meta: TensorMeta) -> torch.Tensor:
        return take_announced(it, meta, group.device)

    lanes = lanes if lanes is not None else Lanes(group, num_buffers)
    chunks = lanes.plan(metas, packed, buffer_size_bytes)
    lanes.begin(buffer_size_bytes, profile)
    batch_bytes = PACK_BATCH_BYTES if lanes.device.type == "cuda" else 0
    k = 0
    for chunk in chunks:
        if len(chunk) == 1:  # travels alone: broadcast the tensor's own storage
            t = next_tensor(metas[chunk[0]])
            if t.numel():
                with lanes.on_comm(after_main=True), lanes.timed("broadcast", on_comm=True):
                    group.broadcast(_as_bytes(t) if packed else t, src=0)
                lanes.hold(t)
                if profile is not None:
                    profile.bytes += t.numel() * t.element_size()
            del t
            continue
        slot = k % lanes.n
        nbytes, slices = lanes.slices(k, chunk, metas)
        if lanes.freed[slot] is not None:
            lanes.main.wait_event(lanes.freed[slot])  # its previous broadcast is done
        with lanes.timed("pack", on_comm=False):
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            held = 0
            for i, dst in zip(chunk, slices):
                src = _as_bytes(next_tensor(metas[i]))
                dsts.append(dst)
                srcs.append(src)
                held += src.numel()
                del src
                if held >= batch_bytes:
                    copy_all(dsts, srcs)
                    dsts, srcs, held = [], [], 0
            if dsts:
                copy_all(dsts, srcs)
            del dsts, srcs
        if nbytes:
            with lanes.on_comm(after_main=True), lanes.timed("broadcast", on_comm=True):
                group.broadcast(lanes.bufs[slot][:nbytes], src=0)
            lanes.freed[slot] = lanes.mark(stream_is_comm=True)
            if profile is not None:
                profile.bytes += nbytes
        k += 1
    lanes.finish()


def receive_tensors(
    group: TransferGroup,
    metas: list[TensorMeta],
    *,
    packed: bool,
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    destination: Destination | None = None,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    lanes: Lanes | None = None,
    profile: WireProfile | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Receivers: yield the tensors of a round in batches (one per tensor, or one per packed chunk).

    The caller copies each batch out (on the current stream) before asking for the next; the views of a packed
    chunk point into a buffer that the next rounds reuse. ``destination`` may name, per tensor, where it finally
    goes: a tensor that travels alone is then received straight into it and the batch yields that very tensor
    (the caller can skip copying it onto itself). With overlap on, the next chunk is already being received
    while the caller copies this one.
    """
    lanes = lanes if lanes is not None else Lanes(group, num_buffers)
    chunks = lanes.plan(metas, packed, buffer_size_bytes)
    lanes.begin(buffer_size_bytes, profile)
    k = 0
    for chunk in chunks:
        if len(chunk) == 1:
            meta = metas[chunk[0]]
            t = _in_place_target(destination, meta, group.device)
            fresh = t is None
            if fresh:
                t = torch.empty(meta.shape, dtype=meta.dtype, device=group.device)
            if t.numel():
                # fresh memory: after the current stream's last use of it
                with lanes.on_comm(after_main=fresh), lanes.timed("broadcast", on_comm=True):
                    group.broadcast(_as_bytes(t) if packed else t, src=0)
                if lanes.overlap:  # the caller's copy (and any reuse of t's memory) comes after the receive
                    lanes.main.wait_event(lanes.mark(stream_is_comm=True))
                if profile is not None:
                    profile.bytes += meta.nbytes
            yield [(meta.name, t)]
            continue
        slot = k % lanes.n
        buf = lanes.buffer(slot)
        nbytes = sum(metas[i].nbytes for i in chunk)
        if nbytes:
            with lanes.on_comm(after_main=False):
                if lanes.freed[slot] is not None:
                    lanes.comm.wait_event(lanes.freed[slot])  # the caller copied its last chunk out
                with lanes.timed("broadcast", on_comm=True):
                    group.broadcast(buf[:nbytes], src=0)
            if lanes.overlap:
                lanes.main.wait_event(lanes.mark(stream_is_comm=True))
            if profile is not None:
                profile.bytes += nbytes
        with lanes.timed("unpack", on_comm=False):
            yield lanes.views(k, chunk, metas)[1]
        lanes.freed[slot] = lanes.mark(stream_is_comm=False)  # after the caller's copies
        k += 1
        del buf
    lanes.finish()

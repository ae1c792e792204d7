"""CUDA IPC weight transfer (vLLM's ``ipc`` backend): trainer and server share one GPU.

NCCL refuses two ranks of one communicator on one GPU, so a one-GPU run cannot
broadcast. With ``ipc`` the trainer instead hands the server *handles* to its
GPU memory and the server copies the weights out itself (docs/protocol.md,
"Weight transfer"; facts read in vLLM 0.33's ``distributed/weight_transfer``):

- ``init_info`` is ``{"packed": bool}``; there is no rendezvous;
- a round is ``start`` -> one or more ``update_weights`` -> ``finish``; each
  ``update_info`` is ``{names, dtype_names, shapes, ipc_handles_pickled}``, the
  last being base64 of pickled handles: per tensor (unpacked) or one for the
  whole buffer (packed, with ``tensor_sizes``), each a dict from the physical
  GPU's UUID to the arguments of ``torch.multiprocessing.reductions.reduce_tensor``;
- packed: the tensors are copied back to back into one reusable buffer; a chunk
  closes *before* the tensor that would overflow it, so one call per chunk, and
  the buffer is refilled only after the server answered;
- the trainer keeps every shared tensor alive until ``finish`` returned (vLLM's
  layer-wise reload may read them until then).

This module holds what both ends share (the GPU's UUID, the handle codec, the
backend choice) and the trainer's exports (:class:`IpcExport`); ``weights/ipc_round.py`` runs a round.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import pickle
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch.multiprocessing.reductions import reduce_tensor

from asyncgrpo.vllm_traits import config_section
from asyncgrpo.weights.collectives import TensorMeta, dtype_name
from asyncgrpo.weights.wire import PACK_BATCH_BYTES, copy_all, take_announced

logger = logging.getLogger(__name__)

INSECURE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"  # vLLM unpickles handles only with this set to 1
BACKENDS = ("auto", "nccl", "gloo", "ipc")
_DEVICE_ARG = 6  # index of the device in reduce_tensor's rebuild arguments (each process has its own numbering)


def device_uuid(device: torch.device | str | int) -> str:
    """The physical GPU's UUID as vLLM keys its handles (``str(props.uuid)``): equal across processes whatever
    ``CUDA_VISIBLE_DEVICES`` each one has, so it tells whether two processes share a GPU."""
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


# ---------------------------------------------------------------------- the handle codec


def encode_handles(handles: Any) -> str:
    """``ipc_handles_pickled``: standard base64 of the pickled handles, as vLLM's HTTP client sends them."""
    return base64.b64encode(pickle.dumps(handles)).decode("ascii")


class _HandleUnpickler(pickle.Unpickler):
    """Unpickles reduce_tensor arguments and nothing else: a pickle naming any other global is refused, so a
    forged request cannot run code through ``find_class`` (the environment switch stays required, as in vLLM)."""

    _ALLOWED: ClassVar[set[tuple[str, str]]] = {
        ("torch", "Tensor"), ("torch", "Size"), ("torch", "UntypedStorage"), ("torch", "TypedStorage"),
        ("torch.nn.parameter", "Parameter"), ("torch._tensor", "Tensor"), ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"), ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict"),
        ("builtins", "int"), ("builtins", "bool"), ("builtins", "bytes"), ("builtins", "str"),
    }  # fmt: skip

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a CUDA IPC handle")


def decode_handles(text: Any, *, allowed: bool | None = None) -> Any:
    """The handles of ``ipc_handles_pickled``.

    Raises:
        PermissionError: ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is not 1 in this process (vLLM refuses too).
        ValueError: not base64, or not a pickle of handles.
    """
    if allowed is None:
        allowed = insecure_serialization_allowed()
    if not allowed:
        raise PermissionError(
            f"Refusing to deserialize `ipc_handles_pickled` without {INSECURE_ENV}=1: start the server with "
            f"{INSECURE_ENV}=1 in its environment (as vLLM needs for the ipc backend)"
        )
    if not isinstance(text, str):
        raise ValueError(f"ipc_handles_pickled must be a base64 string, got {type(text).__name__}")  # noqa: TRY004
    try:
        raw = base64.b64decode(text, validate=True)
        return _HandleUnpickler(io.BytesIO(raw)).load()
    except (ValueError, pickle.UnpicklingError, EOFError, AttributeError, TypeError) as exc:
        raise ValueError(f"ipc_handles_pickled is not base64 of pickled CUDA IPC handles: {exc}") from exc


def insecure_serialization_allowed(environ: dict[str, str] | None = None) -> bool:
    """``VLLM_ALLOW_INSECURE_SERIALIZATION`` as vLLM reads it: an integer, unset meaning 0."""
    value = (os.environ if environ is None else environ).get(INSECURE_ENV, "0").strip() or "0"
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"{INSECURE_ENV} must be 0 or 1, got {value!r}") from None


def rebuild_args(handle: Any, uuid: str, device_index: int) -> list[Any]:
    """The rebuild arguments of ``handle`` (a ``{gpu_uuid: args}`` dict) for this GPU, renumbered to this process.

    Raises:
        ValueError: the handle has no entry for this GPU (the trainer is on another GPU), or is malformed.
    """
    if not isinstance(handle, dict):
        kind = type(handle).__name__
        raise ValueError(f"an IPC handle must be a dict from GPU UUID to rebuild arguments, got {kind}")  # noqa: TRY004
    if uuid not in handle:
        raise ValueError(
            f"IPC handle not found for GPU UUID {uuid} (this server's GPU); the handles are for {sorted(handle)}. "
            "CUDA IPC needs the trainer on the server's GPU: across GPUs use the nccl backend"
        )
    args = handle[uuid]
    if not isinstance(args, (tuple, list)) or len(args) != 15:
        raise ValueError("IPC rebuild arguments must be reduce_tensor's 15-tuple")
    out = list(args)
    out[_DEVICE_ARG] = device_index
    return out


# ---------------------------------------------------------------------- choosing the backend


def server_gpu(info: dict[str, Any]) -> tuple[tuple[str, ...] | None, str | None]:
    """(backends the server accepts, its GPU's UUID) from ``/server_info``; None where it does not say.

    Our server lists its backends and UUID in its ``asyncgrpo`` section. A real vLLM reports only its one
    configured backend (``vllm_config.weight_transfer_config.backend``) and hides GPU UUIDs (``collect_env``
    strips them), so with vLLM the UUID is unknown and the server's backend decides.
    """
    ours = info.get("asyncgrpo") if isinstance(info.get("asyncgrpo"), dict) else {}
    listed = ours.get("weight_transfer_backends")
    if isinstance(listed, list) and all(isinstance(b, str) for b in listed):
        accepted: tuple[str, ...] | None = tuple(listed)
    else:
        one = config_section(info, "vllm_config", "weight_transfer_config").get("backend")
        accepted = (one,) if isinstance(one, str) and one != "auto" else None
    uuid = ours.get("gpu_uuid")
    return accepted, uuid if isinstance(uuid, str) and uuid else None


def choose_backend(
    requested: str, info: dict[str, Any] | None, device: torch.device, trainer_uuid: str | None = None
) -> str:
    """The backend of the weight transfer: ``requested`` when explicit (checked), else from the server and devices.

    ``auto``: ``ipc`` when the server is on this GPU (or accepts nothing else), NCCL when it is on another GPU,
    gloo on CPU; a server that names one backend (a real vLLM) gets that one.

    Raises:
        ValueError: an explicit backend that cannot work with this server (``ipc`` across GPUs, ``nccl`` on the
            server's own GPU, a backend the server does not accept), with what to change.
    """
    if requested not in BACKENDS:
        raise ValueError(f"weight-transfer backend {requested!r} is not one of {', '.join(BACKENDS)}")
    accepted, server_uuid = server_gpu(info or {})
    mine = trainer_uuid or (device_uuid(device) if device.type == "cuda" else None)
    same = None if server_uuid is None or mine is None else server_uuid == mine
    where = f"the trainer's {device} is GPU {mine}, the server's is GPU {server_uuid}"
    if requested == "auto":
        if device.type == "cuda" and (same or accepted == ("ipc",)) and (accepted is None or "ipc" in accepted):
            return "ipc"
        if accepted == ("ipc",):
            raise ValueError(f"the generation server takes weights only over ipc (CUDA IPC), but the trainer's "
                             f"weights are on {device}: put the trainer on the server's GPU")  # fmt: skip
        if same:
            raise ValueError(
                f"the generation server shares the trainer's GPU ({mine}) but accepts only {list(accepted or ())} "
                "weight transfers, and NCCL cannot put two ranks on one GPU: restart it with "
                '--weight-transfer-config \'{"backend": "ipc"}\' (or put it on another GPU)'
            )
        if accepted and accepted[0] in ("nccl", "gloo"):
            return accepted[0]
        return "nccl" if device.type == "cuda" else "gloo"
    if accepted is not None and requested not in accepted:
        raise ValueError(
            f"weight_sync_backend={requested!r} but the server accepts {list(accepted)}: set weight_sync_backend to "
            f"'auto' or one of those, or restart the server with --weight-transfer-config '{{\"backend\": "
            f'"{requested}"}}\''
        )
    if requested == "ipc":
        if device.type != "cuda":
            raise ValueError(f"the ipc backend shares GPU memory, but the trainer's weights are on {device}")
        if same is False:
            raise ValueError(f"weight_sync_backend='ipc' needs the server on the trainer's GPU, but {where}: use "
                             "'nccl' (or 'auto') across GPUs, or start the server on the trainer's GPU")  # fmt: skip
    if requested == "nccl" and same:
        raise ValueError(f"weight_sync_backend='nccl' but the server is on the trainer's GPU ({mine}), and NCCL "
                         "cannot put two ranks on one GPU: use 'ipc' (or 'auto')")  # fmt: skip
    return requested


# ---------------------------------------------------------------------- the trainer's end


class IpcExport:
    """Turns one round's tensors into ``update_info`` bodies, keeping what the server may read alive.

    Unpacked: each tensor is shared where it lies (a parameter costs nothing; a tensor made on the fly, e.g. a
    merged LoRA weight, is kept until the round ends, as vLLM requires) and the round is one call. Packed: the
    tensors are copied into one buffer kept from round to round, one call per chunk; a tensor larger than the
    buffer is shared from its own storage as a chunk of its own.
    """

    def __init__(self, device: torch.device, buffer_size_bytes: int) -> None:
        if device.type != "cuda":
            raise ValueError(f"the ipc backend needs the trainer's weights on a GPU, got {device}")
        self.device = device
        self.uuid = device_uuid(device)
        self.buffer_size_bytes = buffer_size_bytes
        self._buffer: torch.Tensor | None = None
        self._buffer_pickled: str | None = None  # the buffer's handle, exported once per round
        self.keep: list[torch.Tensor] = []  # alive until the round's finish returned
        self.ours: bool | None = None  # the server is the embedded one (pause and start together); None: not asked
        self.round_step = False  # and it takes a round's steps with each update call (POST /weight_round_step)

    def _share(self, t: torch.Tensor) -> dict[str, tuple]:
        self.keep.append(t)
        return {self.uuid: reduce_tensor(t)[1]}

    def bodies(
        self, tensors: Iterable[torch.Tensor], metas: Sequence[TensorMeta], *, packed: bool
    ) -> Iterator[dict[str, Any]]:
        """The ``update_info`` of each call (:func:`plan_calls`), made lazily: the next one is built only after the
        caller posted this one (packed: the buffer is refilled only once the server answered)."""
        it = iter(tensors)
        for kind, idx in plan_calls(metas, packed, self.buffer_size_bytes):
            chunk = [metas[i] for i in idx]
            if kind == "each":
                pickled = encode_handles([self._share(self._take(it, m)) for m in chunk])
            elif kind == "alone":  # larger than the buffer: shared from where it lies, as its own "buffer"
                pickled = encode_handles(self._share(self._take(it, chunk[0]).reshape(-1).view(torch.uint8)))
            else:
                self._pack(it, chunk)
                pickled = self._buffer_handle()
            torch.cuda.current_stream(self.device).synchronize()  # the server reads the bytes as soon as it gets them
            yield update_body(chunk, pickled, packed=packed)
            if kind == "alone":
                self.keep.pop()  # the server copied it out: each call is answered after its copies
                # The server let go of the buffer's mapping to open this tensor: the buffer's next chunk needs an
                # export of its own (torch pairs one export with one release).
                self._buffer_pickled = None

    def _pack(self, it: Iterator[torch.Tensor], chunk: Sequence[TensorMeta]) -> None:
        """Copy one chunk's tensors back to back into the buffer: large ones one device memcpy each, small ones
        (norms) in one multi-tensor launch (``wire.copy_all``), not one launch and a Python round per tensor.
        A tensor made on the fly (a merged LoRA weight) is held until its batch is copied: at most
        ``PACK_BATCH_BYTES`` beyond the buffer, never more than the chunk."""
        buf, used, pending = self._ensure_buffer(), 0, 0
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for m in chunk:
            t = self._take(it, m)
            if m.nbytes:
                dsts.append(buf[used : used + m.nbytes])
                srcs.append(t.reshape(-1).view(torch.uint8))
                pending += m.nbytes
            used += m.nbytes
            del t
            if pending >= PACK_BATCH_BYTES:
                copy_all(dsts, srcs)
                dsts, srcs, pending = [], [], 0
        if dsts:
            copy_all(dsts, srcs)

    def _take(self, it: Iterator[torch.Tensor], meta: TensorMeta) -> torch.Tensor:
        return take_announced(it, meta, self.device)

    def _ensure_buffer(self) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = torch.empty(self.buffer_size_bytes, dtype=torch.uint8, device=self.device)
        return self._buffer

    def _buffer_handle(self) -> str:
        """The buffer's handle, exported once per round (one export, one release by the server's finish)."""
        if self._buffer_pickled is None:
            self._buffer_pickled = encode_handles({self.uuid: reduce_tensor(self._ensure_buffer())[1]})
        return self._buffer_pickled

    def end_round(self) -> None:
        """After ``finish`` returned: drop the shared tensors and give their memory back once the server let go."""
        self.keep.clear()
        self._buffer_pickled = None
        torch.cuda.ipc_collect()

    def close(self) -> None:
        self.end_round()
        self._buffer = None


def plan_calls(metas: Sequence[TensorMeta], packed: bool, buffer_size_bytes: int) -> list[tuple[str, list[int]]]:
    """Which tensors each ``update_weights`` call carries: ``("each", all)`` unpacked (one handle per tensor, one
    call); packed, ``("buffer", idx)`` chunks closed *before* the tensor that would overflow the buffer (vLLM's
    ipc rule, so a chunk never exceeds it) and ``("alone", [i])`` for a tensor larger than the buffer (vLLM
    refuses those; here it is shared from its own storage)."""
    if not packed:
        return [("each", list(range(len(metas))))]
    if buffer_size_bytes <= 0:
        raise ValueError(f"packed_buffer_size_bytes must be > 0, got {buffer_size_bytes}")
    calls: list[tuple[str, list[int]]] = []
    chunk: list[int] = []
    used = 0
    for i, m in enumerate(metas):
        if m.nbytes > buffer_size_bytes:
            calls += [("buffer", chunk)] if chunk else []
            calls.append(("alone", [i]))
            chunk, used = [], 0
            continue
        if chunk and used + m.nbytes > buffer_size_bytes:
            calls.append(("buffer", chunk))
            chunk, used = [], 0
        chunk.append(i)
        used += m.nbytes
    return calls + ([("buffer", chunk)] if chunk else [])


def update_body(metas: Sequence[TensorMeta], pickled: str, *, packed: bool) -> dict[str, Any]:
    """One ``update_info`` as vLLM's HTTP client sends it (``IPCWeightTransferUpdateInfo`` minus raw handles)."""
    body: dict[str, Any] = {
        "names": [m.name for m in metas],
        "dtype_names": [dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
        "ipc_handles_pickled": pickled,
    }
    if packed:
        body["tensor_sizes"] = [m.nbytes for m in metas]
    return body

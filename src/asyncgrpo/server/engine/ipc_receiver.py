"""The server's end of the ``ipc`` weight transfer (CUDA IPC, trainer on this GPU): see ``weights/ipc.py``.

``WeightReceiver`` hands a round here once ``/init_weight_transfer_engine`` carried
``{"packed": bool}`` to a server that accepts ipc (``--weight-transfer-config
'{"backend": "ipc"}'``, or ``auto`` on a GPU). Each ``/update_weights`` is checked
on the HTTP side (names, shapes, the environment switch vLLM needs before it
unpickles handles, that the handles are for this GPU), then run on the engine
thread between steps: the trainer's memory is opened, copied straight into the
engine's parameters (no staging clone) and the call is answered only after the
copies finished, so the trainer may refill its buffer at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from asyncgrpo.server.engine.api import LocalEngineAPI
from asyncgrpo.server.errors import ApiError
from asyncgrpo.weights.collectives import TensorMeta
from asyncgrpo.weights.ipc import decode_handles, device_uuid, rebuild_args
from asyncgrpo.weights.wire import copy_all


class ReceiverState(Protocol):
    """What an ipc round needs of ``weight_receiver.WeightReceiver`` (named here, not imported: that module
    imports this one)."""

    active: bool
    engine: LocalEngineAPI
    _params: dict[str, torch.Tensor] | None
    _host: dict[str, float]

    def _metas(self, info: dict[str, Any]) -> list[TensorMeta]: ...
    def _reject(self, status: int, message: str) -> ApiError: ...


logger = logging.getLogger(__name__)

_INIT_KEYS = {"packed"}  # vLLM 0.33's IPCWeightTransferInitInfo
# IPCWeightTransferUpdateInfo's fields; ``ipc_handles`` (raw tuples) cannot travel in JSON, only as null
_UPDATE_KEYS = {"names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled", "tensor_sizes"}
_NCCL_KEYS = {"master_address", "master_port", "nccl_unique_id_b64", "rank_offset", "world_size"}


def accepted_backends(configured: str | None, device_type: str) -> tuple[str, ...]:
    """The weight transfers a server takes, the one it reports to vLLM clients first.

    ``auto`` on a GPU takes NCCL (a trainer on another GPU) and ipc (a trainer on this one): the trainer
    decides by comparing GPU UUIDs; on CPU it takes gloo. ``none`` (or None) takes nothing.
    """
    if configured in (None, "none"):
        return ()
    if configured == "auto":
        return ("nccl", "ipc") if device_type == "cuda" else ("gloo",)
    return (configured,)


def is_ipc_init(info: dict[str, Any], accepted: tuple[str, ...]) -> bool:
    """Whether ``init_info`` starts an ipc transfer (no rendezvous fields), refusing a mismatch.

    Raises:
        ApiError: an ipc init (only ``packed``) to a server without ipc, or a rendezvous init to an ipc-only server.
    """
    keys = set(info)
    if "ipc" not in accepted:
        if keys and keys <= _INIT_KEYS:
            raise ApiError(400, f"init_info {sorted(info)} is an ipc init (CUDA IPC), but this server receives "
                           f"weights over {list(accepted)}: restart it with --weight-transfer-config "
                           "'{\"backend\": \"ipc\"}' on the trainer's GPU, or send the rendezvous fields of its "
                           "backend", param="init_info")  # fmt: skip
        return False
    if keys & _NCCL_KEYS:
        if accepted == ("ipc",):
            raise ApiError(400, "this server receives weights over ipc (CUDA IPC, trainer on its GPU): init_info is "
                           '{"packed": bool}, with no rendezvous fields', param="init_info")  # fmt: skip
        return False
    return True


class IpcEndpoint:
    """One ipc transfer on the engine's side, from its init to the next init or shutdown.

    Mappings of the trainer's memory are kept from round to round when the same storage came in two rounds in a
    row (the trainer's parameters, its packed buffer): opening one costs far more than the copy of a small
    tensor, and torch answers a new export of a storage that is still mapped by releasing that export at once
    (one release per export, as the trainer's allocator needs). A storage seen once (a merged or gathered
    tensor) is let go at ``finish``; a kept one pins the trainer's block until a round no longer sends it.
    Each export is rebuilt once: the trainer sends one export of its buffer with every chunk of a round.
    """

    def __init__(self, engine: LocalEngineAPI, info: dict[str, Any]) -> None:
        unknown = sorted(set(info) - _INIT_KEYS)
        if unknown:
            raise ApiError(400, f"unknown init_info keys {unknown} for ipc; allowed: {sorted(_INIT_KEYS)}", "init_info")
        packed = info.get("packed", False)
        if not isinstance(packed, bool):
            raise ApiError(400, f"init_info.packed must be a boolean, got {packed!r}", param="init_info")
        if engine.device.type != "cuda":
            raise ApiError(400, f"the ipc backend needs the engine on a GPU; this server runs on {engine.device}")
        self.packed = packed
        self.device: torch.device = engine.device
        self.index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.uuid = device_uuid(self.index)
        self._mapped: tuple[tuple, torch.Tensor] | None = None  # (rebuild arguments, the packed buffer)
        self._held: dict[tuple, torch.Tensor] = {}  # (storage handle, offset) -> a tensor keeping it mapped
        self._seen: set[tuple] = set()  # storages of this round
        self._seen_last: set[tuple] = set()  # and of the last one
        # Per packed layout (buffer storage, names): the (parameter, view of the buffer) pairs, kept while the
        # buffer's mapping is: a round of a whole model then costs one multi-tensor copy, not 310 views and lookups.
        self._plans: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[str, torch.Tensor]]]] = {}
        self._last_info: tuple[list, list, list, list[TensorMeta]] | None = None  # the last update's checked lists
        self.calls: list[dict[str, float]] = []  # this round's timings per update call (ms), see ``timed``
        self.last_round: list[dict[str, float]] = []  # the last finished round's (GET /weight_sync_profile)

    def prepare(
        self, receiver: ReceiverState, info: Any, arrived: float
    ) -> tuple[list[TensorMeta], Callable[[], None], None]:
        """Check one ``update_info`` (HTTP side) and build the engine-thread job that copies it in.

        vLLM 0.33's order and answers (``v1/worker/gpu_worker.py: update_weights``): the worker first checks that
        an update is open, then parses ``IPCWeightTransferUpdateInfo`` and receives, all inside the round; any
        error there is a 500 with its message and ends the round (the caller clears ``active``), so a second
        update without a new start is refused for that, not for its own content. ``--weight-transfer-checks
        strict`` keeps the 400/409 of a bad input or a state clash (``receiver._reject`` maps the status).
        """
        reject = receiver._reject
        if not receiver.active:
            raise reject(409, "start_weight_update must be called before update_weights (no active weight update: "
                         "a failed update ends the one it was in)")  # fmt: skip
        if not isinstance(info, dict):
            raise reject(400, "update_info must be an object")
        unknown = sorted(set(info) - _UPDATE_KEYS)
        if unknown:
            raise reject(400, f"unknown update_info keys {unknown}; allowed: {sorted(_UPDATE_KEYS)}")
        if info.get("ipc_handles") is not None:
            raise reject(400, "ipc_handles cannot travel in JSON: send them pickled in ipc_handles_pickled")
        if info.get("ipc_handles_pickled") is None:
            raise reject(400, "update_info needs ipc_handles_pickled (the ipc backend's CUDA IPC handles)")
        if not info.get("names"):
            raise reject(400, "update_info.names is empty: an ipc update names the tensors its handles hold")
        lists = [info.get("names"), info.get("dtype_names"), info.get("shapes")]
        last = self._last_info
        if last is not None and list(last[:3]) == lists:
            metas = last[3]  # the same layout as the last call's (every round sends the same): checked then
        else:
            metas = receiver._metas(info)
            self._last_info = (*lists, metas)  # type: ignore[assignment]
        try:
            handles = decode_handles(info["ipc_handles_pickled"])
        except PermissionError as exc:
            raise ApiError(500, str(exc)) from exc  # vLLM answers this one with 500 too (a worker error)
        except ValueError as exc:
            raise reject(400, str(exc)) from exc
        try:
            if self.packed:
                job = self._packed_job(receiver, metas, handles, info.get("tensor_sizes"))
            else:
                job = self._unpacked_job(receiver, metas, handles)
        except ValueError as exc:
            raise reject(400, str(exc)) from exc

        checked = (time.perf_counter() - arrived) * 1e3

        def run() -> None:
            start = time.perf_counter()
            timing = {"checked_ms": checked, "engine_start_ms": (start - arrived) * 1e3}
            receiver._host = timing
            job(timing)
            timing["done_ms"] = (time.perf_counter() - arrived) * 1e3
            self.calls.append(timing)

        return metas, run, None

    def _unpacked_job(self, receiver: ReceiverState, metas: list[TensorMeta], handles: Any) -> Callable[[], None]:
        if not isinstance(handles, list) or len(handles) != len(metas):
            raise ValueError(f"unpacked: ipc_handles must be a list of one handle per name ({len(metas)}), got "
                             f"{type(handles).__name__} of {len(handles) if isinstance(handles, list) else '?'}")  # fmt: skip
        args = [rebuild_args(h, self.uuid, self.index) for h in handles]
        for meta, a in zip(metas, args):
            if tuple(a[1]) != meta.shape or a[5] != meta.dtype:
                raise ValueError(f"the handle of {meta.name!r} holds {a[5]} {tuple(a[1])}, not the announced "
                                 f"{meta.dtype} {meta.shape}")  # fmt: skip

        def job(timing: dict[str, float]) -> None:
            with torch.no_grad(), torch.cuda.device(self.index):
                t0 = time.perf_counter()
                tensors = [(m.name, self._rebuild(a)) for m, a in zip(metas, args)]
                timing["rebuild_ms"] = (time.perf_counter() - t0) * 1e3
                self._load(receiver, *self._split(receiver, tensors), timing)
                del tensors  # each mapping released once: the trainer may free the memory

        return job

    def _packed_job(
        self, receiver: ReceiverState, metas: list[TensorMeta], handle: Any, sizes: Any
    ) -> Callable[[], None]:
        if not isinstance(sizes, list) or len(sizes) != len(metas):
            raise ValueError(f"packed: tensor_sizes must list the byte size of each of the {len(metas)} tensors")
        for meta, size in zip(metas, sizes):
            if size != meta.nbytes:
                raise ValueError(f"tensor_sizes gives {size!r} bytes for {meta.name!r}, which is {meta.nbytes}")
        args = rebuild_args(handle, self.uuid, self.index)
        if args[5] != torch.uint8 or len(args[1]) != 1 or sum(sizes) > args[1][0]:
            raise ValueError(f"packed: the handle must be a flat uint8 buffer of at least {sum(sizes)} bytes, got "
                             f"{args[5]} {tuple(args[1])}")  # fmt: skip
        key = tuple(args)
        layout = ((args[7], args[9]), tuple(m.name for m in metas))  # (the buffer's storage, what it holds)

        def job(timing: dict[str, float]) -> None:
            with torch.no_grad(), torch.cuda.device(self.index):
                t0 = time.perf_counter()
                if self._mapped is None or self._mapped[0] != key:
                    self._mapped = (key, self._rebuild(args))
                t1 = time.perf_counter()
                plan = self._plans.get(layout)
                if plan is None:
                    buf, views, at, aligned = self._mapped[1], [], 0, True
                    for meta in metas:
                        piece = buf[at : at + meta.nbytes]
                        if at % meta.dtype.itemsize:  # after an odd-sized tensor of a narrower dtype: not viewable
                            piece, aligned = piece.clone(), False
                        views.append((meta.name, piece.view(meta.dtype).view(meta.shape)))
                        at += meta.nbytes
                    plan = self._split(receiver, views)
                    if aligned:  # views of the mapping itself (a clone is a copy of this round's bytes)
                        self._plans[layout] = plan
                timing["rebuild_ms"], timing["plan_ms"] = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
                self._load(receiver, *plan, timing)

        return job

    @staticmethod
    def _split(
        receiver: ReceiverState, tensors: list[tuple[str, torch.Tensor]]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[tuple[str, torch.Tensor]]]:
        """(parameters, their sources, the rest): the rest are aliases (a tied head) that the engine resolves."""
        params = receiver._params
        if params is None:
            params = receiver._params = {name: p.detach() for name, p in receiver.engine.named_parameters()}
        dsts, srcs, rest = [], [], []
        for name, t in tensors:
            p = params.get(name)
            if p is None or p.device != t.device:
                rest.append((name, t))
            else:
                dsts.append(p)
                srcs.append(t)
        return dsts, srcs, rest

    def _load(
        self,
        receiver: ReceiverState,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        rest: list[tuple[str, torch.Tensor]],
        timing: dict[str, float],
    ) -> None:
        """Copy into the engine's parameters (dtype converted), then wait: the answer frees the trainer's bytes."""
        t0 = time.perf_counter()
        if dsts:
            copy_all(dsts, srcs)
        if rest:
            receiver.engine.load_weights(rest)
        t1 = time.perf_counter()
        torch.cuda.current_stream(self.index).synchronize()
        t2 = time.perf_counter()
        if dsts:
            receiver.engine.reset_prefix_cache()  # cached K/V was computed with the old weights
        timing.update(copy_launch_ms=(t1 - t0) * 1e3, copy_wait_ms=(t2 - t1) * 1e3,
                      reset_ms=(time.perf_counter() - t2) * 1e3, tensors=len(dsts) + len(rest))  # fmt: skip

    def _rebuild(self, args: list[Any]) -> torch.Tensor:
        """The tensor of one export; a storage still mapped is reused (torch then releases the export at once)."""
        t = rebuild_cuda_tensor(*args)
        storage = (args[7], args[9])  # the trainer's allocation handle and the storage's offset in it
        self._seen.add(storage)
        self._held.setdefault(storage, t)
        return t

    def end_round(self) -> None:
        """At ``finish``: keep the mappings of storages sent in this round and the last, let the others go."""
        keep = self._seen & self._seen_last
        self._held = {k: t for k, t in self._held.items() if k in keep}
        self._plans = {k: v for k, v in self._plans.items() if k[0] in keep}
        self._mapped = None
        self.last_round, self.calls = self.calls, []
        self._seen_last, self._seen = self._seen, set()

    def release(self) -> None:
        """At shutdown or a new init: let go of every mapping, so the trainer can free or reuse its memory."""
        self._mapped = None
        self._plans.clear()
        self._held.clear()
        self._seen.clear()
        self._seen_last.clear()

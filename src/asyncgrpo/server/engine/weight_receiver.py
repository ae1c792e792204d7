"""The receiving side of the weight transfer (docs/protocol.md), beside the engine's weights.

``/init_weight_transfer_engine`` joins the group (blocking, on a worker thread);
``/update_weights`` receives every tensor of a round inside
``engine.run_between_steps`` and loads each batch as it arrives, so the engine
never steps on half-loaded weights and at most one packed chunk is held. The
wire format lives in :mod:`asyncgrpo.weights.collectives`, shared with the
trainer's sender. The HTTP routes that drive it are ``server/http/weight_routes.py``; in the engine process
(``process.py``) the same receiver runs behind ``RemoteReceiver``.

Two ways to answer a bad step (``--weight-transfer-checks``). ``vllm`` (the default) answers as vLLM 0.32/0.33
do, traps included, so a client tested here takes the paths it takes against vLLM: every worker-side error is a
500 (a bad ``init_info`` or ``update_info``, update or finish without start, a second start, a shutdown during an
update), a start before init answers 200 and the update fails, a failed update ends the open one (the finish
after it is a 500 too), and names and shapes are not checked before the broadcast: a wrong one fails while
loading, inside the round. ``strict`` refuses bad input before any collective with a 400 (409 for a clash) that
says what to change, for debugging a sender of one's own.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncgrpo.server.engine.api import LocalEngineAPI
from asyncgrpo.server.engine.awaiting import awaited
from asyncgrpo.server.engine.ipc_receiver import IpcEndpoint, accepted_backends, is_ipc_init
from asyncgrpo.server.engine.round_step import round_step
from asyncgrpo.server.engine.settings import ReceiverSettings
from asyncgrpo.server.errors import ApiError
from asyncgrpo.weights.collectives import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    TensorMeta,
    TransferGroup,
    dtype_from_name,
    join_group,
    make_store,
)
from asyncgrpo.weights.wire import Lanes, copy_all, receive_tensors
from asyncgrpo.weights.wire_profile import WireProfile, profiling_requested

logger = logging.getLogger(__name__)

# vLLM 0.33's NCCLWeightTransferInitInfo / NCCLWeightTransferUpdateInfo fields: anything else is a 400.
# Packing is fixed at init; a round carries only the tensor metadata.
_INIT_KEYS = {"master_address", "master_port", "nccl_unique_id_b64", "rank_offset", "world_size", "packed",
              "packed_buffer_size_bytes", "packed_num_buffers"}  # fmt: skip
_UPDATE_KEYS = {"names", "dtype_names", "shapes"}
# How long a new init waits for an abandoned round to let go of the receiver (its collective waits poll every 5 ms).
ABANDON_WAIT_S = 10.0
NOT_CONFIGURED = "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."


def _require(ok: bool, message: str, param: str | None = None) -> None:
    if not ok:
        raise ApiError(400, message, param=param)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class WeightReceiver:
    """The engine's end of the weight-transfer group (one rank: this server has one worker).

    Args:
        engine: the in-process engine (:class:`~asyncgrpo.server.engine.engine.Engine`), whose weights it fills.
        settings: backend, timeout and check mode (:class:`~asyncgrpo.server.engine.settings.ReceiverSettings`;
            the ``checks`` modes are described in the module docstring).
    """

    def __init__(self, engine: LocalEngineAPI, settings: ReceiverSettings) -> None:
        backend, timeout_s = settings.backend, settings.timeout_s
        self.vllm_like = settings.checks == "vllm"
        self.engine = engine
        self.accepts = accepted_backends(backend, engine.device.type)
        self.backend = self.accepts[0] if backend == "auto" else backend  # the group's backend (or "ipc")
        self.ipc: IpcEndpoint | None = None  # an ipc transfer (trainer on this GPU) instead of a group
        self.timeout_s = timeout_s
        self.group: TransferGroup | None = None
        self.packed = False
        self.buffer_size = DEFAULT_PACKED_BUFFER_SIZE_BYTES
        self.num_buffers = DEFAULT_PACKED_NUM_BUFFERS
        self.active = False
        self._last_metas: list[TensorMeta] | None = None
        self._lock = threading.Lock()  # one init/update at a time
        self._joining: tuple[str, float] | None = None  # (rendezvous target, since) while an init joins
        self._receiving = False  # the engine thread is inside a round's collectives (read by a new init)
        self._lanes: Lanes | None = None  # chunk buffers and views, kept from round to round
        self._params: dict[str, torch.Tensor] | None = None  # where each weight lands (the engine's own storage)
        # Timelines of the rounds (ASYNCGRPO_WEIGHT_SYNC_PROFILE=1, or POST /weight_sync_profile): read after a round
        # with GET /weight_sync_profile, so the round itself only records events.
        self.profile = profiling_requested()
        self._last_profile: tuple[dict[str, float], WireProfile] | None = None
        self._host: dict[str, float] = {}

    # ------------------------------------------------------------------ protocol steps (blocking)

    def _check_configured(self) -> None:
        if self.backend is None:
            raise ApiError(500, NOT_CONFIGURED)

    def _reject(self, status: int, message: str) -> ApiError:
        """The error of a bad step: vLLM's worker raises, and the API answers 500 with its message."""
        return ApiError(500 if self.vllm_like else status, message)

    def _expect(self, ok: bool, message: str) -> None:
        if not ok:
            raise self._reject(400, message)

    def init(self, info: Any) -> None:
        """Validate ``init_info`` and join the group; blocks until every rank joined."""
        self._check_configured()
        _require(isinstance(info, dict), "init_info must be an object", "init_info")
        if is_ipc_init(info, self.accepts):
            self._init_ipc(info)
            return
        unknown = sorted(set(info) - _INIT_KEYS)
        self._expect(not unknown, f"unknown init_info keys {unknown}; allowed: {sorted(_INIT_KEYS)}")
        missing = sorted({"rank_offset", "world_size"} - set(info))  # required fields of vLLM's init info
        self._expect(not missing, f"init_info is missing {missing}")
        world, offset = info["world_size"], info["rank_offset"]
        self._expect(_is_int(world) and world >= 2, f"init_info.world_size must be an integer >= 2, got {world!r}")
        self._expect(_is_int(offset) and 1 <= offset < world, f"init_info.rank_offset must be in [1, world_size), got {offset!r}")  # fmt: skip
        packed = info.get("packed", False)
        size = info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)
        nbuf = info.get("packed_num_buffers", DEFAULT_PACKED_NUM_BUFFERS)
        self._expect(isinstance(packed, bool), f"init_info.packed must be a boolean, got {packed!r}")
        self._expect(_is_int(size) and size > 0, f"init_info.packed_buffer_size_bytes must be > 0, got {size!r}")
        self._expect(_is_int(nbuf) and nbuf >= 1, f"init_info.packed_num_buffers must be >= 1, got {nbuf!r}")
        unique_id = store = None
        has_addr = info.get("master_address") is not None or info.get("master_port") is not None
        if info.get("nccl_unique_id_b64") and has_addr:
            raise self._reject(400, "init_info: pass nccl_unique_id_b64 OR master_address/master_port, not both")
        if info.get("nccl_unique_id_b64"):
            self._expect(self.backend == "nccl", "nccl_unique_id_b64 needs the nccl backend; this server uses gloo")
            try:
                unique_id = base64.b64decode(str(info["nccl_unique_id_b64"]), validate=True)
            except (binascii.Error, ValueError) as exc:
                raise self._reject(400, f"init_info.nccl_unique_id_b64 is not base64: {exc}") from exc
            self._expect(len(unique_id) == 128, f"the NCCL unique id must be 128 bytes, got {len(unique_id)}")
        else:
            addr, port = info.get("master_address"), info.get("master_port")
            self._expect(isinstance(addr, str) and _is_int(port) and 0 < port < 65536,
                     "init_info needs master_address and master_port (or nccl_unique_id_b64)")  # fmt: skip
        target = "an NCCL unique id" if unique_id is not None else f"{addr}:{port}"
        if not self._lock.acquire(blocking=False):
            if self._joining is not None or not self._receiving:
                raise ApiError(409, self._busy_message(target))
            # A round is still being received on the old group: its trainer is gone (a trainer forms a new group
            # only after its old one ended), and the collective may wait on it until the timeout. End it.
            self._abandon_round()
            if not self._lock.acquire(timeout=ABANDON_WAIT_S):
                raise ApiError(409, self._busy_message(target))
        self._joining = (target, time.monotonic())
        logger.info("joining the %s weight-transfer group at %s as rank %d of %d", self.backend, target, offset, world)
        try:
            self._close_group()
            if unique_id is None:
                store = make_store(addr, port, rank=offset, world_size=world, timeout_s=self.timeout_s)
            device = self.engine.device if self.backend == "nccl" else torch.device("cpu")
            self.group = join_group(
                self.backend, rank=offset, world_size=world, device=device, timeout_s=self.timeout_s,
                store=store, unique_id=unique_id,
            )  # fmt: skip
            self.packed, self.buffer_size, self.num_buffers = packed, size, nbuf
            self._lanes = Lanes(self.group, nbuf)
            self._params = {name: p.detach() for name, p in self.engine.named_parameters()}
            self._last_metas = None
            self.active = False
        finally:
            self._joining = None
            self._lock.release()

    def _init_ipc(self, info: dict[str, Any]) -> None:
        """Start an ipc transfer: nothing to join, the trainer's handles come with each update."""
        endpoint = IpcEndpoint(self.engine, info)
        if not self._lock.acquire(timeout=ABANDON_WAIT_S):
            raise ApiError(409, self._busy_message("ipc"))
        try:
            self._close_group()
            self.ipc, self.packed = endpoint, endpoint.packed
            self._params = {name: p.detach() for name, p in self.engine.named_parameters()}
            self._last_metas = None
        finally:
            self._lock.release()
        logger.info("weight transfer over ipc (CUDA IPC on GPU %s, packed=%s)", endpoint.uuid, endpoint.packed)

    def _busy_message(self, target: str) -> str:
        """Why an init is refused: a join (perhaps a stray request's, to an address no trainer serves) is pending."""
        joining = self._joining
        if joining is None:
            return "a weight update is being received; retry /init_weight_transfer_engine after it ends"
        where, since = joining
        return (
            f"another /init_weight_transfer_engine is still joining a group at {where} "
            f"({time.monotonic() - since:.0f}s so far, weight-transfer timeout {self.timeout_s:.0f}s); this init "
            f"(to {target}) is refused rather than queued behind it. If no trainer of yours started that join, "
            "it will fail at the timeout; restart the server to clear it sooner"
        )

    def start(self) -> None:
        self._check_configured()
        if (
            self.group is None and self.ipc is None and not self.vllm_like
        ):  # vLLM starts without a group; its update fails
            raise ApiError(400, "no weight-transfer group: call /init_weight_transfer_engine first")
        if self.active:
            raise self._reject(409, "a weight update is already active; call /finish_weight_update first")
        self.active = True

    def _metas(self, info: dict[str, Any]) -> list[TensorMeta]:
        names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        self._expect(all(isinstance(x, list) for x in (names, dtypes, shapes)),
                     "update_info needs the lists names, dtype_names and shapes")  # fmt: skip
        self._expect(len(names) == len(dtypes) == len(shapes),
                     f"names ({len(names)}), dtype_names ({len(dtypes)}) and shapes ({len(shapes)}) differ in length")  # fmt: skip
        if not names:
            self._expect(self._last_metas is not None, "empty update_info lists reuse the last round, but there was none")  # fmt: skip
            return self._last_metas
        params = self.engine.parameter_shapes()
        metas = []
        for name, dname, shape in zip(names, dtypes, shapes):
            self._expect(isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape), f"bad shape {shape!r} for {name!r}")  # fmt: skip
            try:
                dtype = dtype_from_name(dname)
            except ValueError as exc:
                raise self._reject(400, str(exc)) from exc
            if not self.vllm_like:  # vLLM finds these only while loading, inside the round (_check_landing)
                _require(name in params, f"unknown weight name {name!r}: the server's model has no such parameter")
                _require(tuple(shape) == params[name], f"weight {name!r} has shape {params[name]}, not {tuple(shape)}")
            metas.append(TensorMeta(name, dtype, tuple(shape)))
        return metas

    @staticmethod
    def _check_landing(name: str, tensor: torch.Tensor, shapes: dict[str, tuple[int, ...]]) -> None:
        """vLLM-like: a received tensor the model cannot load fails the round here, as vLLM's load_weights does
        after the broadcast of its chunk (the sender's later broadcasts find no receiver)."""
        if name not in shapes:
            raise ValueError(f"load_weights: the model has no parameter {name!r}")
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"load_weights: {name!r} has shape {shapes[name]}, the update sent {tuple(tensor.shape)}")

    def _prepare(self, info: Any, arrived: float) -> tuple[list[TensorMeta], Callable[[], None], WireProfile | None]:
        """Validate ``update_info`` and build the engine-thread job that receives and loads the round."""
        self._check_configured()
        if self.ipc is not None:
            return self.ipc.prepare(self, info, arrived)
        _require(isinstance(info, dict), "update_info must be an object", "update_info")
        unknown = sorted(set(info) - _UPDATE_KEYS)
        self._expect(not unknown, f"unknown update_info keys {unknown}; allowed: {sorted(_UPDATE_KEYS)} (packing is "
                     "fixed by init_info)")  # fmt: skip
        if not self.active:
            raise self._reject(409, "no active weight update: call /start_weight_update first")
        if self.group is None:  # vLLM-like start before init; a failed update ends the active one there
            self.active = False
            raise ApiError(500, "weight transfer not initialized: call /init_weight_transfer_engine first")
        metas = self._metas(info)
        packed, size, nbuf = self.packed, self.buffer_size, self.num_buffers
        group, engine, lanes = self.group, self.engine, self._lanes
        if self._params is None:
            self._params = {name: p.detach() for name, p in engine.named_parameters()}
        params = self._params
        profile = WireProfile(group.device) if self.profile else None
        host = self._host = {}
        shapes = self.engine.parameter_shapes() if self.vllm_like else None

        def receive_and_load() -> None:
            self._receiving = True
            try:
                receive_into_engine()
            finally:
                self._receiving = False

        def receive_into_engine() -> None:
            host["engine_start_ms"] = (time.perf_counter() - arrived) * 1e3
            landed = copied = 0
            # Tensors that travel alone are received straight into their parameter (no staging copy); the others
            # (packed with neighbours) are copied out of their chunk, a chunk's worth in one multi-tensor copy.
            with torch.no_grad():
                for batch in receive_tensors(group, metas, packed=packed, buffer_size_bytes=size,
                                             destination=lambda m: params.get(m.name), num_buffers=nbuf, lanes=lanes,
                                             profile=profile):  # fmt: skip
                    dsts, srcs, rest = [], [], []
                    for name, t in batch:
                        if shapes is not None:
                            self._check_landing(name, t, shapes)
                        p = params.get(name)
                        if p is None or p.device != t.device:
                            rest.append((name, t))  # an alias (a tied head): the engine resolves it
                        elif p.data_ptr() == t.data_ptr() and p.dtype == t.dtype:
                            landed += 1
                        else:
                            dsts.append(p)
                            srcs.append(t)
                    if dsts:
                        copy_all(dsts, srcs)
                        copied += len(dsts)
                    if rest:
                        engine.load_weights(rest)
                host["enqueued_ms"] = (time.perf_counter() - arrived) * 1e3
                group.synchronize("the weight broadcast from the trainer")
                host["synchronized_ms"] = (time.perf_counter() - arrived) * 1e3
                if landed or copied:  # as load_weights does: cached K/V was computed with the old weights
                    engine.reset_prefix_cache()

        return metas, receive_and_load, profile

    def _done(self, metas: list[TensorMeta] | None, profile: WireProfile | None, arrived: float) -> None:
        self._last_metas = metas
        if profile is not None and metas is not None:
            self._host["done_ms"] = (time.perf_counter() - arrived) * 1e3
            self._last_profile = (self._host, profile)

    def _failed_update(self) -> None:
        """vLLM's worker ends the open update when one fails: the finish after it is an error too."""
        if self.vllm_like:
            self.active = False

    def update(self, info: Any) -> None:
        """Receive and load one round; blocks until every tensor is in (its timeline kept when profiling)."""
        arrived = time.perf_counter()
        try:
            metas, job, profile = self._prepare(info, arrived)
        except ApiError:
            self._failed_update()
            raise
        with self._lock:
            try:
                self.engine.run_between_steps(job, timeout=self.timeout_s + 30)
            except Exception:
                self._done(None, None, arrived)
                self._failed_update()
                raise
        self._done(metas, profile, arrived)

    async def update_async(self, info: Any) -> None:
        """:meth:`update` from the event loop: the engine thread runs the round and the loop awaits it, with no
        executor thread in between (a hop less on the round's critical path). Falls back to :meth:`update` on a
        thread while an init or another update holds the receiver."""
        if not self._lock.acquire(blocking=False):
            await asyncio.get_running_loop().run_in_executor(None, self.update, info)
            return
        try:
            arrived = time.perf_counter()
            try:
                metas, job, profile = self._prepare(info, arrived)
            except ApiError:
                self._failed_update()
                raise
            try:
                fut = self.engine.between_steps_future(job)
                await awaited(fut, "the weight update on the engine thread", self.timeout_s + 30)
            except Exception:
                self._done(None, None, arrived)
                self._failed_update()
                raise
            self._done(metas, profile, arrived)
        finally:
            self._lock.release()

    def last_profile(self) -> dict[str, Any] | None:
        """The last profiled round: host steps in ms since ``/update_weights`` arrived (``engine_start``: the engine
        thread took it, ``enqueued``: every receive and copy queued, ``synchronized``: done on the device, ``done``)
        and the device timeline (``wire_profile``)."""
        if self.ipc is not None:  # ipc: the last round's timings per update call, in ms (no device timeline)
            return {"ipc_calls": self.ipc.last_round}
        if self._last_profile is None:
            return None
        host, profile = self._last_profile
        return {"host": host, "wire": profile.summary()}

    def finish(self, version: Any) -> str:
        """End the update, labelling what the engine generates from now on ``version``; returns the version."""
        self._check_configured()
        if not self.active:
            raise self._reject(400, "no active weight update to finish (a failed update ends the one it was in)")
        if self.ipc is not None:
            self.ipc.end_round()
        if version is not None:
            self.engine.set_weight_version(str(version))
        self.active = False
        return str(self.engine.weight_version)

    def set_profile(self, enabled: bool) -> bool:
        """Keep (or stop keeping) the timelines of the next rounds (``GET /weight_sync_profile`` reads the last)."""
        self.profile = bool(enabled)
        return self.profile

    # The event-loop forms of the protocol steps (the engine-process receiver has the same, over its pipe).
    async def start_async(self) -> None:
        self.start()

    async def finish_async(self, version: Any) -> str:
        return self.finish(version)

    def round_step(self, info: Any, begin: bool, end: bool, version: Any) -> str:
        """Ours: ``/weight_round_step``, the update with the steps around it in one call (``round_step.py``)."""
        return round_step(self, self.engine, info, begin=begin, end=end, version=version)

    async def round_step_async(self, info: Any, begin: bool, end: bool, version: Any) -> str:
        return await asyncio.get_running_loop().run_in_executor(None, self.round_step, info, begin, end, version)

    def _abandon_round(self) -> None:
        """End the round the engine thread is receiving (callers saw ``_receiving``): its trainer is gone."""
        group = self.group
        if group is not None:
            logger.warning("a new /init_weight_transfer_engine arrived while a weight round was still being "
                           "received: that round's trainer is gone, so the round is abandoned")  # fmt: skip
            group.abandon("the weight round was abandoned: a new /init_weight_transfer_engine replaced its group")

    def _close_group(self) -> None:
        if self.group is not None:
            if self._receiving:  # the round's collective may wait on a peer that is gone: do not wait with it
                self._abandon_round()
            else:
                self.group.close()
        self.group = None
        if self.ipc is not None:
            self.ipc.release()
        self._lanes = self._params = self.ipc = None
        self.active = False

    def shutdown(self) -> None:
        if self.vllm_like and self.active:
            raise ApiError(500, "Cannot release a trainer connection during a weight update")
        with self._lock:
            self._close_group()

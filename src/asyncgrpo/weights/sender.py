"""Trainer side of the weight transfer: push the policy's weights to a generation server.

Speaks docs/protocol.md's weight-transfer endpoints (real vLLM or our embedded
server) with torch primitives only (no vLLM import). One round (SPEC G10):

    POST /pause?mode=keep&clear_cache=true -> POST /start_weight_update
    -> (thread) POST /update_weights  while rank 0 broadcasts
    -> join -> POST /finish_weight_update with POST /reset_prefix_cache (concurrently) -> POST /resume

A step the server answers with any error status ends the round there: the update is closed and the server
resumed (``weights/round_control.py``; vLLM answers its worker's errors with 500, not 400). Names and shapes are
checked against the server's checkpoint before the first broadcast (``weights/name_check.py``).

    sender = WeightSender()
    sender.init(AsyncServerClient(url), server_world_size=1, backend="auto", device="cuda:0")
    timings = sender.update_model(model, version="step-1")  # or update(named tensors, ...)
    sender.close()

With ``metadata`` (``update_model`` takes it from global shapes) tensors are pulled,
sent and dropped one at a time: a lazy source (FSDP gathers, PEFT merges) costs one
full tensor (plus one packed chunk), not the model.
"""

from __future__ import annotations

import base64
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from asyncgrpo.errors import ServerError, WeightTransferError
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.vllm_traits import reuses_update_metadata
from asyncgrpo.weights import nccl_lib
from asyncgrpo.weights.collectives import (
    DEFAULT_PACKED_NUM_BUFFERS,
    DEFAULT_SENDER_BUCKET_BYTES,
    TensorMeta,
    TransferGroup,
    dtype_name,
    join_group,
    make_store,
)
from asyncgrpo.weights.ipc import IpcExport, choose_backend
from asyncgrpo.weights.ipc_round import ipc_round
from asyncgrpo.weights.loop_thread import LoopThread as _LoopThread
from asyncgrpo.weights.loop_thread import local_address_towards as _local_address_towards
from asyncgrpo.weights.name_check import ServerWeights, check_round, server_weights
from asyncgrpo.weights.policy import policy_weight_metadata, policy_weights
from asyncgrpo.weights.restart import DEFAULT_RESTART_TIMEOUT_S, RestartRecovery
from asyncgrpo.weights.round_control import RoundControl
from asyncgrpo.weights.wire import Lanes, send_tensors
from asyncgrpo.weights.wire_profile import WireProfile, enable_server_profiles, profiling_requested, server_profile

logger = logging.getLogger(__name__)

DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S = 1800.0  # matches vllm_server_timeout's default
_T = TypeVar("_T")


def _values(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[torch.Tensor]:
    """The tensors of ``(name, tensor)`` pairs, each released here before the next pair is made."""
    for item in named_tensors:
        yield item[1]
        del item


def _as_meta(m: TensorMeta | tuple[str, torch.dtype, Sequence[int]]) -> TensorMeta:
    return m if isinstance(m, TensorMeta) else TensorMeta(m[0], m[1], tuple(m[2]))


def _raise_if_failed(fut: concurrent.futures.Future, what: str) -> Callable[[], None]:
    def check() -> None:
        if fut.done() and fut.exception() is not None:
            raise WeightTransferError(f"the server failed {what}: {fut.exception()}") from fut.exception()

    return check


class WeightSender(RestartRecovery):
    """Rank 0 of the weight-transfer group: pushes named tensors to one generation server.

    Args:
        timeout_s: bound on every wait of a round (rendezvous, HTTP calls, broadcasts).
        packed_buffer_size_bytes: packed chunk size; sent in ``init_info`` so both sides agree (256 MiB: see
            ``DEFAULT_SENDER_BUCKET_BYTES``; vLLM's own default is 1 GiB).
        packed_num_buffers: sent in ``init_info`` (vLLM's double buffering; we send chunks in order).
        restart_timeout_s: a round that finds the server gone (no answer, or a server without our group: it
            restarted) waits this long for it, then forms the group again and pushes; 0 = fail at once.
        profile: record each round's device timeline (``wire_profile``) into ``last_breakdown``; default: the
            ``ASYNCGRPO_WEIGHT_SYNC_PROFILE`` environment variable. Off, only host wall times are kept.
        check_names: before a round's first broadcast, check its names and shapes against the checkpoint the
            server loaded (``weights/name_check.py``): vLLM itself fails on a wrong one inside the collective.

    ``last_breakdown`` holds the last round's steps in milliseconds from its start (``pause``, ``start``,
    ``enqueued``: the host queued every broadcast, ``synchronized``: they finished here, ``update_reply``: the
    server loaded them, ``finish_and_reset``, ``resume``), plus ``sender_wire`` and the server's ``receiver``
    timeline (our server's ``/weight_sync_profile``, read after the round) when profiling.
    """

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S,
        packed_buffer_size_bytes: int = DEFAULT_SENDER_BUCKET_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
        restart_timeout_s: float = DEFAULT_RESTART_TIMEOUT_S,
        profile: bool | None = None,
        check_names: bool = True,
    ) -> None:
        if restart_timeout_s < 0:
            raise ValueError(f"restart_timeout_s must be >= 0, got {restart_timeout_s}")
        self.restart_timeout_s = restart_timeout_s
        self.restarts = 0  # times the group was formed again after the server came back
        self._init_kwargs: dict[str, Any] | None = None
        if timeout_s <= 0 or packed_buffer_size_bytes <= 0 or packed_num_buffers < 1:
            raise ValueError(
                f"need timeout_s > 0, packed_buffer_size_bytes > 0, packed_num_buffers >= 1; got {timeout_s}, "
                f"{packed_buffer_size_bytes}, {packed_num_buffers}"
            )
        self.timeout_s = timeout_s
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.packed_num_buffers = packed_num_buffers
        self.packed = True
        self.backend: str | None = None
        self.group: TransferGroup | None = None
        self._ipc: IpcExport | None = None  # the ipc backend (server on this GPU): no group, handles instead
        self._client: AsyncServerClient | None = None
        self._loop: _LoopThread | None = None
        self._last_metas: list[TensorMeta] | None = None
        self._lanes: Lanes | None = None  # chunk buffers kept from round to round
        self.profile = profiling_requested() if profile is None else profile
        self.last_breakdown: dict[str, Any] = {}
        self._server_profiles: bool | None = None  # whether the server keeps timelines (ours does on request)
        self.check_names = check_names
        self._server_weights: ServerWeights | None = None  # the server's checkpoint names and shapes (check_names)
        self._reuse_metadata = True  # the server takes empty update_info lists as the last round's (vLLM >= 0.33)

    # ------------------------------------------------------------------ set-up

    def _http(self, coro: Coroutine[Any, Any, _T], what: str) -> _T:
        assert self._loop is not None, "call init() first"
        return self._loop.run(coro, self.timeout_s, what)

    def _pick_backend(self, backend: str, device: torch.device) -> str:
        """``backend`` checked against the server, or (``auto``) chosen from it: ``weights/ipc.choose_backend``."""
        assert self._client is not None
        try:
            info = self._http(self._client.server_info(), "GET /server_info")
        except ServerError as exc:
            logger.info("GET /server_info failed (%s); choosing the backend from the device", exc)
            info = None
        return choose_backend(backend, info if isinstance(info, dict) else None, device)

    def init(
        self,
        client: AsyncServerClient,
        server_world_size: int | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        *,
        packed: bool = True,
        master_address: str | None = None,
    ) -> None:
        """Form the group with the server: mint the rendezvous, post ``/init_weight_transfer_engine`` from a
        thread while joining, then the warm-up all-reduce.

        Args:
            client: a client of the server (cloned: the sender runs its own event loop).
            server_world_size: the server's worker count (``GET /get_world_size`` when None).
            backend: ``nccl``, ``gloo``, ``ipc`` or ``auto`` (``ipc`` when the server is on this GPU, else the
                server's choice in ``/server_info``, else by device).
            device: where rank 0's tensors go for broadcasting (a CUDA device for nccl; default cuda/cpu).
            packed: default packing of rounds (sent in ``init_info``).
            master_address: the address the server reaches this machine at (gloo); guessed from the route.

        Raises:
            WeightTransferError: the server rejected the init, or the rendezvous timed out.
        """
        if self.group is not None or self._ipc is not None:
            raise RuntimeError("WeightSender.init() was already called; close() first")
        self._init_kwargs = {"client": client, "server_world_size": server_world_size, "backend": backend,
                             "device": device, "packed": packed, "master_address": master_address}  # fmt: skip
        self._client = client.clone()
        self._loop = _LoopThread()
        if server_world_size is None:
            server_world_size = self._http(self._client.world_size(), "GET /get_world_size")
        dev = (
            torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.backend = self._pick_backend(backend, dev)
        world_size = server_world_size + 1
        self.packed = packed
        if self.backend == "ipc":
            self._init_ipc(dev, packed)
            return
        init_info: dict[str, Any] = {
            "rank_offset": 1,
            "world_size": world_size,
            "packed": packed,
            "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
            "packed_num_buffers": self.packed_num_buffers,
        }
        store = unique_id = None
        if self.backend == "nccl":
            unique_id = nccl_lib.unique_id()
            init_info["nccl_unique_id_b64"] = base64.b64encode(unique_id).decode("ascii")
        else:
            address = master_address or _local_address_towards(self._client.base_url)
            store = make_store(address, 0, rank=0, world_size=world_size, timeout_s=self.timeout_s)
            init_info.update(master_address=address, master_port=int(store.port))
        fut = self._loop.submit(self._client.init_weight_transfer_engine(init_info, timeout=self.timeout_s))
        self.group = self._join(fut, world_size, dev, store, unique_id)
        self._lanes = Lanes(self.group, self.packed_num_buffers)
        try:
            fut.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise WeightTransferError("joined the group but POST /init_weight_transfer_engine did not return") from None
        except ServerError as exc:
            raise WeightTransferError(
                f"POST /init_weight_transfer_engine failed after the group formed: {exc}"
            ) from exc
        self._read_server_traits()
        logger.info("weight transfer to %s ready (%s, world size %d)", self._client.base_url, self.backend, world_size)

    def _init_ipc(self, dev: torch.device, packed: bool) -> None:
        """No group to form: tell the server the packing (``init_info = {"packed": bool}``, vLLM's ipc)."""
        assert self._client is not None
        self._ipc = IpcExport(dev, self.packed_buffer_size_bytes)
        try:
            self._http(self._client.init_weight_transfer_engine({"packed": packed}, timeout=self.timeout_s),
                       "POST /init_weight_transfer_engine")  # fmt: skip
        except ServerError as exc:
            self._ipc = None
            raise WeightTransferError(f"the server rejected POST /init_weight_transfer_engine (ipc): {exc}") from exc
        self._read_server_traits()
        logger.info("weight transfer to %s ready (ipc: CUDA IPC on GPU %s)", self._client.base_url, self._ipc.uuid)

    def _read_server_traits(self) -> None:
        """``/version`` (whether empty update_info lists mean "as last round") and, with ``check_names``, the names
        and shapes of the server's checkpoint."""
        assert self._client is not None
        try:
            version = self._http(self._client.version(), "GET /version")
        except ServerError as exc:
            logger.info("no /version from %s (%s): sending full metadata every round", self._client.base_url, exc)
            version = ""
        self._reuse_metadata = reuses_update_metadata(version)
        if self.check_names:
            self._server_weights = self._http(server_weights(self._client), "GET /server_info")

    def _join(
        self, fut: concurrent.futures.Future, world_size: int, dev: torch.device, store: Any, unique_id: bytes | None
    ) -> TransferGroup:
        """Join in a thread, watching the HTTP call: a server that rejects the init ends the wait at once."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["group"] = join_group(
                    self.backend, rank=0, world_size=world_size, device=dev, timeout_s=self.timeout_s,
                    store=store, unique_id=unique_id,
                )  # fmt: skip
            except BaseException as exc:  # noqa: BLE001 - re-raised below in the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=run, name="asyncgrpo-weight-transfer-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout_s + 10
        while thread.is_alive():
            thread.join(0.05)
            if fut.done() and fut.exception() is not None:
                raise WeightTransferError(
                    f"the server rejected POST /init_weight_transfer_engine: {fut.exception()}"
                ) from fut.exception()
            if time.monotonic() > deadline:
                raise WeightTransferError(f"timed out after {self.timeout_s:.0f}s joining the weight-transfer group")
        if "error" in box:
            server = "; POST /init_weight_transfer_engine has not returned yet (see the server's log)"
            if fut.done():
                server = f"; the server said: {fut.exception()}" if fut.exception() is not None else ""
            raise WeightTransferError(f"joining the weight-transfer group failed: {box['error']}{server}") from box[
                "error"
            ]
        return box["group"]

    # ------------------------------------------------------------------ one round

    def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: str,
        packed: bool | None = None,
        metadata: Sequence[TensorMeta | tuple[str, torch.dtype, Sequence[int]]] | None = None,
        barrier: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """Push one set of weights and label it ``version``.

        Args:
            named_tensors: ``(hf_name, full tensor)`` in send order. With ``metadata`` they are pulled one at a
                time while broadcasting (each dropped before the next); without it they are listed first, which
                is free for existing parameters but holds every tensor made on the fly.
            version: the weight version the server reports from now on (``/weight_info``, ``weight_versions``).
            packed: must equal the ``init`` choice when given (packing is fixed at init, as in vLLM).
            metadata: ``TensorMeta`` or ``(name, dtype, shape)`` per tensor, in the order of ``named_tensors``.
            barrier: called after the pause (e.g. waiting for the other trainer ranks); timed as ``barrier_s``.

        A server that stopped answering or restarted (``restart_timeout_s`` > 0) is waited for, the group formed
        again and the round repeated once (without ``metadata`` or ``barrier``: those cannot be replayed).

        Returns:
            ``{"pause_s", "barrier_s", "transfer_s", "total_s"}`` (SPEC G10).

        Raises:
            WeightTransferError: a broadcast or a server step failed; the group should be considered broken.
        """
        if metadata is None:
            named_tensors = list(named_tensors)  # kept for one more try after a server restart
        try:
            return self._update_once(named_tensors, version=version, packed=packed, metadata=metadata, barrier=barrier)
        except (WeightTransferError, ServerError) as exc:
            if metadata is not None or barrier is not None or not self._server_vanished(exc):
                raise
        self._await_return()
        self._reinit()
        return self._update_once(named_tensors, version=version, packed=packed, metadata=metadata, barrier=barrier)

    def _update_once(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: str,
        packed: bool | None = None,
        metadata: Sequence[TensorMeta | tuple[str, torch.dtype, Sequence[int]]] | None = None,
        barrier: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """One round of :meth:`update` (after checking the server is the one we formed the group with)."""
        if (self.group is None and self._ipc is None) or self._client is None or self._loop is None:
            raise RuntimeError("call WeightSender.init() before update()")
        self._ensure_server()
        client, group = self._client, self.group
        if metadata is None:
            items = list(named_tensors)
            metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in items]
            tensors: Iterable[torch.Tensor] = [t for _, t in items]
            del items
        else:
            metas = [_as_meta(m) for m in metadata]
            tensors = _values(named_tensors)
        use_packed = self.packed if packed is None else packed
        if use_packed != self.packed:  # vLLM's update_info has no packed field (400): packing is fixed at init
            raise ValueError(f"packed={use_packed} differs from init(packed={self.packed}); packing is fixed when the "
                             "group forms: close() and init() again with the packing you want")  # fmt: skip
        # Before the clock starts: the same metadata as last round travels as empty lists (vLLM >= 0.33 reuses its
        # last), and the very list object lets the wire's cached plan be found without comparing it again.
        same = metas == self._last_metas
        if same:
            metas = self._last_metas
        else:
            check_round(metas, self._server_weights, client.base_url)  # before any pause or broadcast
        if self._ipc is not None:
            self._last_metas = metas  # checked; ipc sends every round's metadata (its handles change)
            return ipc_round(self, tensors, metas, version=version, barrier=barrier)
        reuse = same and self._reuse_metadata
        update_info: dict[str, Any] = {
            "names": [] if reuse else [m.name for m in metas],
            "dtype_names": [] if reuse else [dtype_name(m.dtype) for m in metas],
            "shapes": [] if reuse else [list(m.shape) for m in metas],
        }

        if self.profile and self._server_profiles is None:
            self._server_profiles = self._http(enable_server_profiles(client), "POST /weight_sync_profile")
        t0 = time.perf_counter()
        steps: dict[str, Any] = {}

        def step(name: str) -> None:
            steps[name] = (time.perf_counter() - t0) * 1e3

        control = RoundControl(client, self._loop.run, self.timeout_s)
        control.pause()
        t1 = time.perf_counter()
        step("pause")
        try:
            if barrier is not None:
                barrier()
                step("barrier")
            control.start()
        except BaseException:
            control.abandon()
            raise
        t2 = time.perf_counter()
        step("start")
        fut = self._loop.submit(client.update_weights(update_info, timeout=self.timeout_s))
        group.abort_check = _raise_if_failed(fut, "POST /update_weights")
        profile = WireProfile(group.device) if self.profile else None
        try:
            send_tensors(group, tensors, metas, packed=use_packed, buffer_size_bytes=self.packed_buffer_size_bytes,
                         num_buffers=self.packed_num_buffers, lanes=self._lanes, profile=profile)  # fmt: skip
            step("enqueued")
            group.synchronize("the weight broadcast")
            step("synchronized")
        except Exception as exc:
            # Do not wait on the HTTP thread: the server may be stuck inside the collective.
            self._last_metas = None
            if not fut.done():  # no answer yet: the server may be inside the collective, so no call waits on it
                raise WeightTransferError(f"broadcasting weights to {client.base_url} failed: {exc}; "
                                          f"{control.left_paused_message()}") from exc  # fmt: skip
            control.abandon()
            if isinstance(exc, WeightTransferError):
                raise
            raise WeightTransferError(f"broadcasting weights to {client.base_url} failed: {exc}") from exc
        finally:
            group.abort_check = None
        try:
            fut.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise WeightTransferError(f"the broadcast finished but POST /update_weights did not return; "
                                      f"{control.left_paused_message()}") from None  # fmt: skip
        except ServerError as exc:
            self._last_metas = None
            control.abandon()
            raise WeightTransferError(f"POST /update_weights failed: {exc}") from exc
        step("update_reply")
        self._last_metas = metas
        try:
            control.finish(version)
        except (ServerError, WeightTransferError) as exc:
            control.abandon()
            raise WeightTransferError(
                f"the weights reached {client.base_url} but closing the round failed: {exc}"
            ) from exc
        self._pushed_version = str(version)
        step("finish_and_reset")
        control.resume()
        t3 = time.perf_counter()
        step("resume")
        if profile is not None:
            steps["sender_wire"] = profile.summary()
            if self._server_profiles:
                steps["receiver"] = self._http(server_profile(client), "GET /weight_sync_profile")
        self.last_breakdown = steps
        return {"pause_s": t1 - t0, "barrier_s": t2 - t1, "transfer_s": t3 - t2, "total_s": t3 - t0}

    def update_model(self, model: torch.nn.Module, *, version: str, **kwargs: Any) -> dict[str, float]:
        """:meth:`update` with ``model``'s policy weights (``weights/policy.py``: PEFT merged, FSDP2 gathered).

        Metadata from global shapes up front, then one full tensor made, sent and freed at a time. Under FSDP
        the other ranks call ``join_policy_gathers(model)`` meanwhile (the gathers are collective).
        """

        def once() -> dict[str, float]:
            metadata = policy_weight_metadata(model)
            return self.update(policy_weights(model), version=version, metadata=metadata, **kwargs)

        try:
            return once()
        except (WeightTransferError, ServerError) as exc:
            if kwargs.get("barrier") is not None or not self._server_vanished(exc):
                raise  # other ranks joined this round's gathers: it cannot be replayed alone
        self._await_return()
        self._reinit()
        return once()  # the policy's tensors are made again, so the round can be repeated whole

    def close(self, *, shutdown_server_side: bool = True) -> None:
        """Leave the group (and ask the server to drop its side); the sender can be ``init``-ed again."""
        if self._client is not None and self._loop is not None:
            if shutdown_server_side and (self.group is not None or self._ipc is not None):
                # Both ranks tear down together: NCCL's communicator destroy may wait for the peer's, so post the
                # server's shutdown first, leave the group here, then collect the answer.
                fut = self._loop.submit(self._client.shutdown_weight_transfer_engine(timeout=30.0))
                if self.group is not None:
                    self.group.close()
                    self.group = None
                try:
                    fut.result(timeout=35.0)
                except (ServerError, WeightTransferError, concurrent.futures.TimeoutError) as exc:
                    logger.warning("POST /shutdown_weight_transfer_engine failed: %r", exc)
            try:
                self._loop.run(self._client.close(), 10.0, "closing the HTTP session")
            except WeightTransferError as exc:
                logger.warning("%s", exc)
            self._loop.close()
        if self.group is not None:
            self.group.close()
        if self._ipc is not None:
            self._ipc.close()
        self.group = self._client = self._loop = self._ipc = None
        self._last_metas = self._lanes = self._server_profiles = None

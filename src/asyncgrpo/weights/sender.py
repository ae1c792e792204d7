"""Trainer side of the weight transfer: push the policy's weights to one or several generation servers.

Speaks docs/protocol.md's weight-transfer endpoints (real vLLM or our embedded server) with torch primitives
only (no vLLM import). One round (SPEC G10), written once for every server count; every HTTP step runs on all
servers at once, bounded by the timeout, and its errors name the server:

    POST /pause?mode=keep&clear_cache=true -> barrier -> POST /start_weight_update
    -> (loop thread) POST /update_weights  while rank 0 broadcasts every tensor (made once)
    -> join -> POST /finish_weight_update with POST /reset_prefix_cache (concurrently) -> POST /resume

A step a server answers with any error status ends the round there: the update is closed and the server resumed
(``weights/round_control.py``; vLLM answers its worker's errors with 500, not 400); a server that did not answer
may be inside the collective, so no call waits on it. Names and shapes are checked against each server's
checkpoint before the first broadcast (``weights/name_check.py``). A server that stops answering is handled by
the sender's policy (``weights/lost_server.py``): one server is waited for and the group formed again
(``RestartRecovery``), one of several is dropped (``DropDeadServers``). The ``ipc`` backend (a server on this
GPU) plugs into the same sender: its round is ``weights/ipc_round.py``.

    sender = WeightSender()
    sender.init(client, server_world_size=1, backend="auto", device="cuda:0")  # or a list of clients and sizes
    timings = sender.update_model(model, version="step-1")  # or update(named tensors, ...)
    sender.close()

With ``metadata`` (``update_model`` takes it from global shapes) tensors are pulled, sent and dropped one at a
time: a lazy source (FSDP gathers, PEFT merges) costs one full tensor (plus one packed chunk), not the model.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any, TypeVar

import torch

from asyncgrpo.errors import ServerError, WeightTransferError
from asyncgrpo.vllm_traits import reuses_update_metadata
from asyncgrpo.weights.base import ServerControl
from asyncgrpo.weights.collective_round import Meta, collective_round
from asyncgrpo.weights.collectives import (
    DEFAULT_PACKED_NUM_BUFFERS,
    DEFAULT_SENDER_BUCKET_BYTES,
    TransferGroup,
)
from asyncgrpo.weights.ipc import IpcExport, choose_backend
from asyncgrpo.weights.links import TOPOLOGIES, ServerLink, form_group, resolve_device, wait_all
from asyncgrpo.weights.loop_thread import LoopThread
from asyncgrpo.weights.lost_server import DEFAULT_RESTART_TIMEOUT_S, DropDeadServers, LostServerPolicy, RestartRecovery
from asyncgrpo.weights.name_check import server_weights
from asyncgrpo.weights.policy import policy_weight_metadata, policy_weights
from asyncgrpo.weights.round_control import RoundControl
from asyncgrpo.weights.wire import Lanes
from asyncgrpo.weights.wire_profile import profiling_requested

logger = logging.getLogger(__name__)

DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S = 1800.0  # matches vllm_server_timeout's default
HEALTH_TIMEOUT_S = 10.0  # the /health look at a server whose step failed
_T = TypeVar("_T")


class WeightSender:
    """Rank 0 of the weight transfer to one or several generation servers (see the module docstring).

    Args:
        timeout_s: bound on every wait of a round (rendezvous, each HTTP step on all servers, broadcasts).
        packed_buffer_size_bytes: packed chunk size; sent in ``init_info`` so both sides agree (256 MiB: see
            ``DEFAULT_SENDER_BUCKET_BYTES``; vLLM's own default is 1 GiB).
        packed_num_buffers: sent in ``init_info`` (vLLM's double buffering; we send chunks in order).
        restart_timeout_s: with one server, a round that finds it gone (no answer, or a server without our group:
            it restarted) waits this long for it, then forms the group again and pushes; 0 = fail at once.
        profile: record each round's device timeline (``wire_profile``) into ``last_breakdown`` (one server);
            default: the ``ASYNCGRPO_WEIGHT_SYNC_PROFILE`` environment variable. Off, only host wall times are kept.
        check_names: before a round's first broadcast, check its names and shapes against the checkpoint each
            server loaded (``weights/name_check.py``): vLLM itself fails on a wrong one inside the collective.
        topology: ``per_server`` (one group per server) or ``shared`` (one group for all): ``weights/links.py``.
        on_drop: called with a dropped server's index (its place in the ``init`` list).
        policy: what to do about a server that stops answering; default: ``RestartRecovery`` for one server,
            ``DropDeadServers`` for several (``weights/lost_server.py``).

    ``last_breakdown`` holds the last round's steps in milliseconds from its start (``pause``, ``start``,
    ``enqueued``: the host queued every broadcast, ``synchronized``: they finished here, ``update_reply``: the
    servers loaded them, ``finish_and_reset``, ``resume``), plus ``sender_wire`` and the server's ``receiver``
    timeline (our server's ``/weight_sync_profile``, read after the round) when profiling.
    """

    served_model: str | None = None  # merged weights replace the server's own model

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S,
        packed_buffer_size_bytes: int = DEFAULT_SENDER_BUCKET_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
        restart_timeout_s: float = DEFAULT_RESTART_TIMEOUT_S,
        profile: bool | None = None,
        check_names: bool = True,
        topology: str = "per_server",
        on_drop: Callable[[int], None] | None = None,
        policy: LostServerPolicy | None = None,
    ) -> None:
        if timeout_s <= 0 or packed_buffer_size_bytes <= 0 or packed_num_buffers < 1:
            raise ValueError(
                f"need timeout_s > 0, packed_buffer_size_bytes > 0, packed_num_buffers >= 1; got {timeout_s}, "
                f"{packed_buffer_size_bytes}, {packed_num_buffers}"
            )
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology {topology!r} is not one of {TOPOLOGIES}")
        self._restart_policy = RestartRecovery(restart_timeout_s)  # checks restart_timeout_s
        self.policy: LostServerPolicy | None = policy
        self.timeout_s, self.topology, self.on_drop = timeout_s, topology, on_drop
        self.packed_buffer_size_bytes, self.packed_num_buffers = packed_buffer_size_bytes, packed_num_buffers
        self.profile = profiling_requested() if profile is None else profile
        self.check_names = check_names
        self.packed = True
        self.backend: str | None = None
        self.links: dict[str, ServerLink] = {}  # live servers by URL, in the init order
        self.dropped: dict[str, str] = {}  # URL -> why
        self.pushed: dict[str, str] = {}  # URL -> the version the last finished round labelled (kept over re-forms)
        self.shared: TransferGroup | None = None  # the shared topology's one group
        self.restarts = 0  # times the group was formed again after the server came back
        self.barrier: Callable[[], None] | None = None  # push(): the other trainer ranks' meeting point
        self.last_breakdown: dict[str, Any] = {}
        self._init_kwargs: dict[str, Any] | None = None
        self._ipc: IpcExport | None = None  # the ipc backend (server on this GPU): no group, handles instead
        self._loop: LoopThread | None = None
        self._lanes: Lanes | None = None  # one group's chunk buffers, kept from round to round
        self._server_profiles: bool | None = None  # whether the server keeps timelines (ours does on request)

    # ------------------------------------------------------------------ set-up

    def _loop_run(self, coro: Coroutine[Any, Any, _T], timeout: float, what: str) -> _T:
        assert self._loop is not None, "call init() first"
        return self._loop.run(coro, timeout, what)

    def _http(self, coro: Coroutine[Any, Any, _T], what: str) -> _T:
        return self._loop_run(coro, self.timeout_s, what)

    @property
    def _client(self) -> ServerControl | None:
        """The first live server's client (one server: its client)."""
        return next(iter(self.links.values())).client if self.links else None

    @property
    def group(self) -> TransferGroup | None:
        """The group the tensors are broadcast into when there is one (shared, or the one server's)."""
        if self.shared is not None or len(self.links) != 1:
            return self.shared
        return next(iter(self.links.values())).group

    def init(
        self,
        clients: ServerControl | Sequence[ServerControl],
        server_world_size: int | Sequence[int] | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        *,
        packed: bool = True,
        master_address: str | None = None,
    ) -> None:
        """Form the group(s) with every server: post each ``/init_weight_transfer_engine`` while joining.

        Args:
            clients: a client of each server (cloned: the sender runs its own event loop), or one client.
            server_world_size: each server's worker count (one int for one server; ``GET /get_world_size`` when
                None).
            backend: ``nccl``, ``gloo``, ``ipc`` or ``auto``. One server: ``ipc`` when it is on this GPU, else its
                choice in ``/server_info``, else by device (``weights/ipc.choose_backend``). Several: ``nccl`` or
                ``gloo`` (``auto``: by device).
            device: where rank 0's tensors go for broadcasting (a CUDA device for nccl; default cuda/cpu).
            packed: packing of every round (sent in ``init_info``).
            master_address: the address the servers reach this machine at (gloo); guessed from the route.

        Raises:
            WeightTransferError: a server rejected its init, or the rendezvous timed out (named by URL).
        """
        if self._loop is not None:
            raise RuntimeError("WeightSender.init() was already called; close() first")
        many = not hasattr(clients, "base_url")
        clients = list(clients) if many else [clients]  # type: ignore[list-item, arg-type]
        sizes = server_world_size if isinstance(server_world_size, Sequence) else [server_world_size] * len(clients)
        if not clients or len(sizes) != len(clients):
            raise ValueError(f"need one world size per server: {len(clients)} servers, {len(sizes)} sizes")
        if len(clients) > 1 and backend == "ipc":
            raise ValueError("weight_sync_backend='ipc' shares the trainer's GPU with one server; several servers "
                             "(vllm_server_base_url) need 'nccl' or 'auto'")  # fmt: skip
        self._init_kwargs = {"clients": clients if many else clients[0], "server_world_size": server_world_size,
                             "backend": backend, "device": device, "packed": packed,
                             "master_address": master_address}  # fmt: skip
        if self.policy is None:
            self.policy = self._restart_policy if len(clients) == 1 else DropDeadServers()
        self._loop = LoopThread()
        try:
            self._connect(clients, sizes, device, backend, packed, master_address)
        except BaseException:
            # A failed init (NCCL missing, a rejected init, a timeout) must not leave the cloned clients' HTTP
            # sessions and the loop thread open (issue 44 item 3). The servers are asked to drop their side only
            # when a group formed: the half of one that never formed ends on the server's own rendezvous timeout.
            formed = self.shared is not None or any(link.group is not None for link in self.links.values())
            self.close(shutdown_server_side=formed)
            raise

    def _connect(self, clients: list[ServerControl], sizes: Sequence[int | None], device: torch.device | str | None,
                 backend: str, packed: bool, master_address: str | None) -> None:  # fmt: skip
        """``init``'s work once the loop runs: a link per server, the backend, the group(s), the traits."""
        for i, (c, size) in enumerate(zip(clients, sizes)):
            link = ServerLink(c.clone(), 0, i)
            link.world_size = (
                int(size) if size is not None else self._http(link.client.world_size(), "GET /get_world_size")
            )
            self.links[link.url] = link
        dev, self.packed = resolve_device(device), packed
        self.backend = self._pick_backend(backend, dev)
        if self.backend == "ipc":
            self._init_ipc(dev, packed)
        else:
            self._form = functools.partial(
                form_group,
                loop=self._loop,
                backend=self.backend,
                device=dev,
                packed=packed,
                timeout_s=self.timeout_s,
                buffer_bytes=self.packed_buffer_size_bytes,
                num_buffers=self.packed_num_buffers,
                master_address=master_address,
            )
            if self.topology == "shared" and len(self.links) > 1:
                self.shared = self._form(list(self.links.values()))
            else:
                for link in self.links.values():
                    link.group = self._form([link])
            if len(self.links) == 1:  # one group: its chunk buffers are kept from round to round
                self._lanes = Lanes(self.group, self.packed_num_buffers)
        for link in self.links.values():
            self._read_traits(link)

    def _pick_backend(self, backend: str, dev: torch.device) -> str:
        """One server: ``backend`` checked against it, or (``auto``) chosen from it. Several: nccl or gloo."""
        if len(self.links) > 1:
            return backend if backend in ("nccl", "gloo") else ("nccl" if dev.type == "cuda" else "gloo")
        client = next(iter(self.links.values())).client
        try:
            info = self._http(client.server_info(), "GET /server_info")
        except ServerError as exc:
            logger.info("GET /server_info failed (%s); choosing the backend from the device", exc)
            info = None
        return choose_backend(backend, info if isinstance(info, dict) else None, dev)

    def _init_ipc(self, dev: torch.device, packed: bool) -> None:
        """No group to form: tell the server the packing (``init_info = {"packed": bool}``, vLLM's ipc)."""
        client = next(iter(self.links.values())).client
        self._ipc = IpcExport(dev, self.packed_buffer_size_bytes)
        try:
            self._http(client.init_weight_transfer_engine({"packed": packed}, timeout=self.timeout_s),
                       "POST /init_weight_transfer_engine")  # fmt: skip
        except ServerError as exc:
            self._ipc = None
            raise WeightTransferError(f"the server rejected POST /init_weight_transfer_engine (ipc): {exc}") from exc
        logger.info("weight transfer to %s ready (ipc: CUDA IPC on GPU %s)", client.base_url, self._ipc.uuid)

    def _read_traits(self, link: ServerLink) -> None:
        """``/version`` (whether empty update_info lists mean "as last round") and, with ``check_names``, the names
        and shapes of the server's checkpoint."""
        try:
            version = self._http(link.client.version(), f"GET /version of {link.url}")
        except ServerError as exc:
            logger.info("no /version from %s (%s): sending full metadata every round", link.url, exc)
            version = ""
        link.reuse_metadata = reuses_update_metadata(version)
        if self.check_names:
            link.weights = self._http(server_weights(link.client), f"GET /server_info of {link.url}")

    # ------------------------------------------------------------------ servers that stop answering

    def reform(self) -> None:
        """Leave every group without asking the servers, and form them again as ``init`` did (a restart)."""
        assert self._init_kwargs is not None
        kwargs = dict(self._init_kwargs)
        self.close(shutdown_server_side=False)
        self.init(**kwargs)

    def gone(self, url: str) -> bool:
        """Whether the server stopped answering ``/health``."""
        try:
            return not self._loop_run(self.links[url].client.health(), HEALTH_TIMEOUT_S + 5, f"GET /health of {url}")
        except WeightTransferError:
            return True

    def drop(self, url: str, reason: str) -> None:
        """Go on without ``url`` (``DropDeadServers``); fails when no server is left."""
        link = self.links.pop(url)
        self.dropped[url] = reason
        link.group = None  # never destroy a communicator whose peer is gone (it may wait for it)
        if self._loop is not None:
            self._loop.submit(link.client.close())  # its HTTP session only: nothing is sent
        logger.warning("generation server %s dropped from the weight sync (%s): continuing with %d server(s): %s",
                       url, reason, len(self.links), ", ".join(self.links) or "none")  # fmt: skip
        if self.on_drop is not None:
            self.on_drop(link.index)
        if not self.links:
            gone = "; ".join(f"{u} ({why})" for u, why in self.dropped.items())
            raise WeightTransferError(f"every generation server is gone: {gone}. Restart them and resume from the "
                                      "last checkpoint")  # fmt: skip

    def reform_shared(self) -> None:
        """The shared group lost a member: the survivors leave it and a new one forms without the dead."""
        self._each(lambda c: c.shutdown_weight_transfer_engine(timeout=30.0), "POST /shutdown_weight_transfer_engine")
        self.shared = self._lanes = None  # the old communicator has a dead peer: dropped, never destroyed
        for link in self.links.values():
            link.last_metas = None
        self.shared = self._form(list(self.links.values()))

    def _each(self, make: Callable[[ServerControl], Coroutine[Any, Any, Any]], what: str) -> None:
        """One HTTP step on every live server at once; a failure goes to the policy (drop, or fail the round)."""
        assert self._loop is not None and self.policy is not None
        futures = {url: self._loop.submit(make(link.client)) for url, link in self.links.items()}
        if len(futures) == 1:  # one server: the step's own error (a ServerError stays one)
            url, fut = next(iter(futures.items()))
            try:
                fut.result(self.timeout_s)
            except concurrent.futures.TimeoutError:
                fut.cancel()
                exc = WeightTransferError(f"timed out after {self.timeout_s:.0f}s waiting for {what}")
                self.policy.lost(self, self.links[url], exc)
            except (ServerError, OSError) as exc:
                self.policy.lost(self, self.links[url], exc)
            return
        wait_all(futures, what, self.timeout_s, lambda url, exc: self.policy.lost(self, self.links[url], exc))

    def _control(self, link: ServerLink) -> RoundControl:
        assert self._loop is not None
        return RoundControl(link.client, self._loop.run, self.timeout_s)

    # ------------------------------------------------------------------ one round

    def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: str,
        packed: bool | None = None,
        metadata: Sequence[Meta] | None = None,
        barrier: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """Push one set of weights to every live server and label it ``version``.

        Args:
            named_tensors: ``(hf_name, full tensor)`` in send order. With ``metadata`` they are pulled one at a
                time while broadcasting (each dropped before the next); without it they are listed first, which
                is free for existing parameters but holds every tensor made on the fly.
            version: the weight version the servers report from now on (``/weight_info``, ``weight_versions``).
            packed: must equal the ``init`` choice when given (packing is fixed at init, as in vLLM).
            metadata: ``TensorMeta`` or ``(name, dtype, shape)`` per tensor, in the order of ``named_tensors``.
            barrier: called after the pause (e.g. waiting for the other trainer ranks); timed as ``barrier_s``.

        With ``RestartRecovery`` a server that stopped answering or restarted is waited for, the group formed
        again and the round repeated once (without ``metadata`` or ``barrier``: those cannot be replayed).

        Returns:
            ``{"pause_s", "barrier_s", "transfer_s", "total_s"}`` (SPEC G10).

        Raises:
            WeightTransferError: a broadcast or a server step failed; the group should be considered broken.
        """
        if self._loop is None or self.policy is None:
            raise RuntimeError("call WeightSender.init() before update()")
        if metadata is None:
            named_tensors = list(named_tensors)  # kept for one more try after a server restart
        once = lambda: collective_round(self, named_tensors, version, packed, metadata, barrier)
        return self.policy.run(self, once, replayable=metadata is None and barrier is None)

    def update_model(self, model: torch.nn.Module, *, version: str, **kwargs: Any) -> dict[str, float]:
        """:meth:`update` with ``model``'s policy weights (``weights/policy.py``: PEFT merged, FSDP2 gathered).

        Metadata from global shapes up front, then one full tensor made, sent and freed at a time. Under FSDP
        the other ranks call ``join_policy_gathers(model)`` meanwhile (the gathers are collective). A round
        repeated after a restart makes the policy's tensors again (not when other ranks joined its gathers).
        """
        if self.policy is None:
            raise RuntimeError("call WeightSender.init() before update_model()")

        def once() -> dict[str, float]:
            metadata = policy_weight_metadata(model)
            return collective_round(self, policy_weights(model), version, kwargs.get("packed"), metadata,
                                    kwargs.get("barrier"))  # fmt: skip

        return self.policy.run(self, once, replayable=kwargs.get("barrier") is None)

    def push(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """``WeightSync.push`` on rank 0: the policy as version ``step-<step>``, and the round's metrics."""
        t = self.update_model(model, version=f"step-{step}", barrier=self.barrier)  # streamed
        return {"perf/weight_sync_s": t["pause_s"] + t["barrier_s"] + t["transfer_s"],
                "perf/weight_sync_pause_s": t["pause_s"], "perf/weight_sync_barrier_s": t["barrier_s"],
                "perf/weight_sync_transfer_s": t["transfer_s"]}  # fmt: skip

    def _abandon(self, futures: dict[str, concurrent.futures.Future]) -> list[str]:
        """A failed round: close it on every live server outside the collective and resume it (``RoundControl``).
        A server whose /update_weights has not answered may be inside the broadcast: no call waits on it; its
        message is returned (and logged when several servers share the round)."""
        paused = []
        for url, link in list(self.links.items()):
            link.last_metas = None
            fut = futures.get(url)
            if fut is not None and not fut.done():
                paused.append(self._control(link).left_paused_message())
                if len(self.links) > 1:
                    logger.error("%s", paused[-1])
                continue
            self._control(link).abandon()
        return paused

    def close(self, *, shutdown_server_side: bool = True) -> None:
        """Leave the group(s), asking each live server to drop its side (posted first: NCCL destroys pair up);
        the sender can be ``init``-ed again."""
        if self._loop is None:
            return
        futures = {}
        if shutdown_server_side:
            futures = {u: self._loop.submit(link.client.shutdown_weight_transfer_engine(timeout=30.0))
                       for u, link in self.links.items()}  # fmt: skip
        for g in [self.shared, *(link.group for link in self.links.values())]:
            if g is not None:
                g.close()
        try:
            wait_all(futures, "POST /shutdown_weight_transfer_engine", 35.0, None)
        except WeightTransferError as exc:
            logger.warning("%s", exc)
        for link in self.links.values():
            try:
                self._loop.run(link.client.close(), 10.0, "closing the HTTP session")
            except WeightTransferError as exc:
                logger.warning("%s", exc)
        self._loop.close()
        if self._ipc is not None:
            self._ipc.close()
        self._loop = self._ipc = self.shared = self._lanes = self._server_profiles = None
        self.links = {}

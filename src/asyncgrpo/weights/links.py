"""Weight sync to several generation servers in one round (SPEC X5).

Two topologies, both speaking docs/protocol.md's ``init_info`` (so real vLLM servers join as they are):

* ``per_server`` (default): one group per server, trainer rank 0 + that server's workers (``rank_offset``
  1). Each tensor is broadcast into every group in turn: N servers cost N broadcasts of the weights.
* ``shared``: one group of ``1 + Σ server world sizes`` ranks; server k joins at ``rank_offset`` 1 + the
  world sizes of the servers before it. Each tensor is broadcast once to all (NCCL pipelines it).

One round walks the servers together; every HTTP step runs on all of them at once, bounded by the
timeout, and its errors name the server:

    pause all -> barrier -> start all -> post /update_weights to all -> broadcast every tensor (made once)
    -> join all -> finish all (version) -> reset prefix caches -> resume all

A server that stops answering is dropped by URL with a warning and the run goes on with the rest (the
rollout worker hears of it through ``on_drop``): found before a round (``/health`` fails, or
``/weight_info`` reports other weights than the run pushed: it restarted), at an HTTP step, or, with
``per_server`` over gloo, during the broadcast (the others still get every tensor). With ``shared``, the
group is formed again without it before the next round; a death *during* a shared broadcast, or during
any NCCL broadcast, stops the run (a collective with a dead peer cannot be abandoned). When no server
is left the round fails naming every URL.

    sender = FanoutSender(timeout_s=600)
    sender.init([AsyncServerClient(u) for u in urls], world_sizes=[1, 1], backend="gloo", device="cpu")
    timings = sender.update_model(model, version="step-1")
"""

from __future__ import annotations

import base64
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

import torch

from asyncgrpo.errors import ServerError, WeightTransferError
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.vllm_traits import reuses_update_metadata
from asyncgrpo.weights import nccl_lib
from asyncgrpo.weights.collectives import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    TensorMeta,
    TransferGroup,
    dtype_name,
    make_store,
)
from asyncgrpo.weights.fanout_group import FanoutGroup, join_watching
from asyncgrpo.weights.loop_thread import LoopThread as _LoopThread
from asyncgrpo.weights.loop_thread import local_address_towards as _local_address_towards
from asyncgrpo.weights.name_check import ServerWeights, check_round, server_weights
from asyncgrpo.weights.policy import policy_weight_metadata, policy_weights
from asyncgrpo.weights.round_control import RoundControl
from asyncgrpo.weights.sender import DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S
from asyncgrpo.weights.wire import send_tensors

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0  # the /health and /weight_info look before a round
TOPOLOGIES = ("per_server", "shared")


class _Link:
    """What the sender keeps per server: its client (on the sender's loop), size, last round's metadata."""

    def __init__(self, client: AsyncServerClient, world_size: int, index: int) -> None:
        self.client, self.world_size, self.index = client, world_size, index
        self.group: TransferGroup | None = None  # per_server topology
        self.last_metas: list[TensorMeta] | None = None
        self.pushed: str | None = None  # the version the last finished round labelled
        self.weights: ServerWeights | None = None  # its checkpoint's names and shapes (checked before broadcasting)
        self.reuse_metadata = True  # it takes empty update_info lists as the last round's (vLLM >= 0.33)


class FanoutSender:
    """Rank 0 of the weight transfer to several generation servers (see the module docstring).

    Args:
        timeout_s: bound on every wait of a round (each HTTP step on all servers, each broadcast).
        packed_buffer_size_bytes, packed_num_buffers: sent in each ``init_info`` (as ``WeightSender``).
        topology: ``per_server`` (one group per server) or ``shared`` (one group for all).
        on_drop: called with a dropped server's index (its place in the ``init`` list).
        check_names: check each round's names and shapes against every server's checkpoint before broadcasting
            (``weights/name_check.py``), as ``WeightSender`` does.
    """

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
        topology: str = "per_server",
        on_drop: Callable[[int], None] | None = None,
        check_names: bool = True,
    ) -> None:
        if topology not in TOPOLOGIES:
            raise ValueError(f"topology {topology!r} is not one of {TOPOLOGIES}")
        self.timeout_s, self.topology, self.on_drop = timeout_s, topology, on_drop
        self.packed_buffer_size_bytes, self.packed_num_buffers = packed_buffer_size_bytes, packed_num_buffers
        self.links: dict[str, _Link] = {}  # live servers by URL, in the config's order
        self.dropped: dict[str, str] = {}  # URL -> why
        self.shared: TransferGroup | None = None
        self.packed = True
        self.backend = "gloo"
        self.device = torch.device("cpu")
        self.restarts = 0  # WeightSender's field: a dropped server is never taken back
        self.check_names = check_names
        self._loop: _LoopThread | None = None

    # ------------------------------------------------------------------ forming the groups

    def init(
        self,
        clients: Sequence[AsyncServerClient],
        world_sizes: Sequence[int],
        backend: str = "auto",
        device: torch.device | str | None = None,
        *,
        packed: bool = True,
    ) -> None:
        """Form the group(s) with every server.

        Raises:
            WeightTransferError: a server rejected its init or a rendezvous timed out (named by URL).
        """
        if not clients or len(world_sizes) != len(clients):
            raise ValueError(f"need one world size per server: {len(clients)} servers, {len(world_sizes)} sizes")
        dev = (
            torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        )
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        self.device, self.packed = dev, packed
        self.backend = backend if backend in ("nccl", "gloo") else ("nccl" if dev.type == "cuda" else "gloo")
        self._loop = _LoopThread()
        for i, (c, size) in enumerate(zip(clients, world_sizes)):
            self.links[c.base_url] = _Link(c.clone(), int(size), i)
        self._form_groups()
        for url, link in self.links.items():
            version = self._loop.run(link.client.version(), self.timeout_s, f"GET /version of {url}")
            link.reuse_metadata = reuses_update_metadata(version)
            if self.check_names:
                link.weights = self._loop.run(server_weights(link.client), self.timeout_s, f"GET /server_info of {url}")

    def _form_groups(self) -> None:
        if self.topology == "shared":
            self.shared = self._form(list(self.links.values()))
            return
        for link in self.links.values():
            link.group = self._form([link])

    def _form(self, links: list[_Link]) -> TransferGroup:
        """One group of rank 0 and ``links``' workers: post every init from the loop thread while joining."""
        assert self._loop is not None
        world = 1 + sum(link.world_size for link in links)
        base: dict[str, Any] = {"world_size": world, "packed": self.packed,
                                "packed_buffer_size_bytes": self.packed_buffer_size_bytes,
                                "packed_num_buffers": self.packed_num_buffers}  # fmt: skip
        store = unique_id = None
        if self.backend == "nccl":
            unique_id = nccl_lib.unique_id()
            base["nccl_unique_id_b64"] = base64.b64encode(unique_id).decode("ascii")
        else:
            address = _local_address_towards(links[0].client.base_url)
            store = make_store(address, 0, rank=0, world_size=world, timeout_s=self.timeout_s)
            base.update(master_address=address, master_port=int(store.port))
        futures, offset = {}, 1
        for link in links:
            info = {**base, "rank_offset": offset}
            offset += link.world_size
            coro = link.client.init_weight_transfer_engine(info, timeout=self.timeout_s)
            futures[link.client.base_url] = self._loop.submit(coro)
        group = join_watching(futures, self.backend, world, self.device, self.timeout_s, store, unique_id)
        self._wait_all(futures, "POST /init_weight_transfer_engine")
        logger.info("weight transfer to %s ready (%s, %s, world size %d)", ", ".join(futures), self.topology,
                    self.backend, world)  # fmt: skip
        return group

    # ------------------------------------------------------------------ servers that stop answering

    def _wait_all(self, futures: dict[str, concurrent.futures.Future], what: str, *, drop: bool = False) -> None:
        """Wait for one step on every server; a failure drops a gone server (``drop``) or fails naming it."""
        deadline = time.monotonic() + self.timeout_s
        for url, fut in futures.items():
            try:
                fut.result(max(deadline - time.monotonic(), 0.0))
            except concurrent.futures.TimeoutError:
                fut.cancel()
                err = WeightTransferError(f"{url}: timed out after {self.timeout_s:.0f}s waiting for {what}")
                if not drop:
                    raise err from None
                self._lost(url, err)
            except (ServerError, OSError) as exc:
                if not drop:
                    raise WeightTransferError(f"{what} failed on {url}: {exc}") from exc
                self._lost(url, exc)

    def _each(self, make: Callable[[AsyncServerClient], Coroutine[Any, Any, Any]], what: str) -> None:
        assert self._loop is not None
        futures = {url: self._loop.submit(make(link.client)) for url, link in self.links.items()}
        self._wait_all(futures, what, drop=True)

    def _gone(self, url: str) -> bool:
        assert self._loop is not None
        try:
            return not self._loop.run(self.links[url].client.health(), HEALTH_TIMEOUT_S + 5, f"GET /health of {url}")
        except WeightTransferError:
            return True

    def _lost(self, url: str, exc: BaseException) -> None:
        """A step failed on ``url``: drop the server if it stopped answering, else fail the round naming it."""
        if url not in self.links:
            return
        if not self._gone(url):
            raise WeightTransferError(f"weight sync to {url} failed: {exc}") from exc
        self._drop(url, f"stopped answering: {exc}")

    def _drop(self, url: str, reason: str) -> None:
        link = self.links.pop(url)
        self.dropped[url] = reason
        link.group = None  # never destroy a communicator whose peer is gone (it may wait for it)
        logger.warning("generation server %s dropped from the weight sync (%s): continuing with %d server(s): %s",
                       url, reason, len(self.links), ", ".join(self.links) or "none")  # fmt: skip
        if self.on_drop is not None:
            self.on_drop(link.index)
        if not self.links:
            gone = "; ".join(f"{u} ({why})" for u, why in self.dropped.items())
            raise WeightTransferError(f"every generation server is gone: {gone}. Restart them and resume from the "
                                      "last checkpoint")  # fmt: skip

    def _check_before_round(self) -> None:
        """Drop servers that stopped answering or restarted; with ``shared``, re-form the group without them."""
        assert self._loop is not None
        before = len(self.links)
        for url in list(self.links):
            link = self.links[url]
            call = link.client.request("GET", "/weight_info", retries=0, timeout=HEALTH_TIMEOUT_S)
            try:
                info = self._loop.run(call, HEALTH_TIMEOUT_S + 5, f"GET /weight_info of {url}")
            except (ServerError, WeightTransferError) as exc:
                if isinstance(exc, ServerError) and exc.status not in (None, 503):
                    continue  # it answers (a real vLLM outside dev mode has no /weight_info)
                self._drop(url, f"no answer before the weight sync: {exc}")
                continue
            version = info.get("weight_version") if isinstance(info, dict) else None
            if link.pushed is not None and version != link.pushed:
                self._drop(url, f"it restarted: it serves weight version {version!r}, not {link.pushed!r} pushed last")
        if self.topology == "shared" and len(self.links) < before:
            self._reform_shared()

    def _reform_shared(self) -> None:
        """The shared group lost a member: the survivors leave it and a new one forms without the dead."""
        self._each(lambda c: c.shutdown_weight_transfer_engine(timeout=30.0), "POST /shutdown_weight_transfer_engine")
        self.shared = None  # the old communicator has a dead peer: dropped, never destroyed
        for link in self.links.values():
            link.last_metas = None
        self.shared = self._form(list(self.links.values()))

    # ------------------------------------------------------------------ one round

    def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: str,
        metadata: Sequence[TensorMeta] | None = None,
        barrier: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """Push one set of weights to every live server and label it ``version``.

        Args:
            named_tensors: ``(hf_name, full tensor)`` in send order; pulled one at a time with ``metadata``.
            version: the weight version every server reports from now on.
            metadata: ``TensorMeta`` per tensor (``update_model`` gives it from global shapes).
            barrier: called after the pause (the other trainer ranks); timed as ``barrier_s``.

        Returns:
            ``{"pause_s", "barrier_s", "transfer_s", "total_s"}`` as ``WeightSender.update``.
        """
        if self._loop is None:
            raise RuntimeError("call FanoutSender.init() before update()")
        items = None if metadata is not None else list(named_tensors)
        metas = list(metadata) if items is None else [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in items]
        tensors = (t for _, t in (named_tensors if items is None else items))
        for url, link in self.links.items():
            check_round(metas, link.weights, url)  # before any pause or broadcast
        self._check_before_round()
        t0, t1, t2 = self._open_round(barrier)
        futures: dict[str, concurrent.futures.Future] = {}
        try:
            self._send_round(tensors, metas, version, futures)
        except BaseException:
            self._abandon_round(futures)
            raise
        t3 = time.perf_counter()
        return {"pause_s": t1 - t0, "barrier_s": t2 - t1, "transfer_s": t3 - t2, "total_s": t3 - t0}

    def _send_round(self, tensors: Iterable[torch.Tensor], metas: list[TensorMeta], version: str,
                    futures: dict[str, concurrent.futures.Future]) -> None:  # fmt: skip
        """The opened round: post every /update_weights, broadcast, then finish, reset and resume every server."""
        assert self._loop is not None
        for url, link in self.links.items():
            reuse = metas == link.last_metas and link.reuse_metadata
            info = {"names": [] if reuse else [m.name for m in metas],
                    "dtype_names": [] if reuse else [dtype_name(m.dtype) for m in metas],
                    "shapes": [] if reuse else [list(m.shape) for m in metas]}  # fmt: skip
            futures[url] = self._loop.submit(link.client.update_weights(info, timeout=self.timeout_s))
        self._broadcast(tensors, metas, futures)
        self._wait_all({u: f for u, f in futures.items() if u in self.links}, "POST /update_weights", drop=True)
        for link in self.links.values():
            link.last_metas = metas
        futures.clear()  # every server answered its update: from here on a failure never finds one inside it
        self._each(lambda c: c.finish_weight_update(version, timeout=self.timeout_s), "POST /finish_weight_update")
        for link in self.links.values():
            link.pushed = str(version)
        self._each(lambda c: c.reset_prefix_cache(), "POST /reset_prefix_cache")
        self._each(lambda c: c.resume(timeout=self.timeout_s), "POST /resume")

    def _abandon_round(self, futures: dict[str, concurrent.futures.Future]) -> None:
        """A failed round: close it on every live server outside the collective and resume it (``RoundControl``).
        A server whose /update_weights has not answered may be inside the broadcast: no call waits on it."""
        assert self._loop is not None
        for url, link in list(self.links.items()):
            fut = futures.get(url)
            if fut is not None and not fut.done():
                link.last_metas = None
                logger.error("%s", RoundControl(link.client, self._loop.run, self.timeout_s).left_paused_message())
                continue
            link.last_metas = None
            RoundControl(link.client, self._loop.run, self.timeout_s).abandon()

    def _open_round(self, barrier: Callable[[], None] | None) -> tuple[float, float, float]:
        """Pause and start the update on every server; returns the times before, after the pause, after start.

        A server lost meanwhile leaves the shared group with a dead member: the survivors close their update,
        the group forms again without it and the round opens again (the barrier is not repeated).
        """
        while True:
            n = len(self.links)
            t0 = t1 = time.perf_counter()
            try:
                pause = lambda c: c.pause("keep", timeout=self.timeout_s, clear_cache=True)
                self._each(pause, "POST /pause?mode=keep")
                t1 = time.perf_counter()
                if barrier is not None:
                    barrier()
                    barrier = None
                self._each(lambda c: c.start_weight_update(timeout=self.timeout_s), "POST /start_weight_update")
            except BaseException:
                self._abandon_round({})
                raise
            if self.topology != "shared" or len(self.links) == n:
                return t0, t1, time.perf_counter()
            self._each(lambda c: c.finish_weight_update(None, timeout=self.timeout_s), "POST /finish_weight_update")
            self._resume_quietly()
            self._reform_shared()

    def _broadcast(self, tensors: Iterable[torch.Tensor], metas: list[TensorMeta], futures: dict) -> None:
        """Every tensor made once; broadcast to all servers (once, or into each server's group)."""

        def failed(url: str) -> Callable[[], None]:
            def check() -> None:
                fut = futures[url]
                if fut.done() and fut.exception() is not None:
                    raise WeightTransferError(f"POST /update_weights failed on {url}: {fut.exception()}")

            return check

        if self.shared is not None:
            group = self.shared
            checks = [failed(u) for u in self.links]

            def any_failed() -> None:
                for check in checks:
                    check()

            group.abort_check = any_failed
        else:

            def lost(url: str, exc: BaseException) -> None:
                if self.backend == "nccl" and self._gone(url):  # the stream holds a collective with a dead peer
                    raise WeightTransferError(f"generation server {url} died during the NCCL weight broadcast; NCCL "
                                              "cannot abandon it. Restart the servers and resume from the last "
                                              "checkpoint") from exc  # fmt: skip
                self._lost(url, exc)

            members = {}
            for url, link in self.links.items():
                assert link.group is not None
                link.group.abort_check = failed(url)
                members[url] = link.group
            group = FanoutGroup(members, lost)
        try:
            send_tensors(group, tensors, metas, packed=self.packed, buffer_size_bytes=self.packed_buffer_size_bytes)
            group.synchronize("the weight broadcast")
        except WeightTransferError as exc:
            raise WeightTransferError(f"the weight broadcast to {', '.join(self.links)} failed: {exc}") from exc
        finally:
            for g in [self.shared, *(link.group for link in self.links.values())]:
                if g is not None:
                    g.abort_check = None

    def update_model(self, model: torch.nn.Module, *, version: str, **kwargs: Any) -> dict[str, float]:
        """:meth:`update` with ``model``'s policy weights, made one full tensor at a time (as ``WeightSender``'s)."""
        return self.update(policy_weights(model), version=version, metadata=policy_weight_metadata(model), **kwargs)

    def _resume_quietly(self) -> None:
        """After a failed start of a round, leave no live server paused (errors only logged)."""
        assert self._loop is not None
        for url, link in self.links.items():
            try:
                self._loop.run(link.client.resume(timeout=30.0), 35.0, f"POST /resume of {url}")
            except (ServerError, WeightTransferError) as exc:
                logger.warning("could not resume %s after a failed weight sync: %s", url, exc)

    def close(self) -> None:
        """Leave the group(s), asking each live server to drop its side (posted first: NCCL destroys pair up)."""
        if self._loop is None:
            return
        futures = {u: self._loop.submit(link.client.shutdown_weight_transfer_engine(timeout=30.0))
                   for u, link in self.links.items()}  # fmt: skip
        for g in [self.shared, *(link.group for link in self.links.values())]:
            if g is not None:
                g.close()
        try:
            self._wait_all(futures, "POST /shutdown_weight_transfer_engine")
        except WeightTransferError as exc:
            logger.warning("%s", exc)
        for link in self.links.values():
            self._loop.run(link.client.close(), 10.0, "closing the HTTP session")
        self._loop.close()
        self._loop, self.shared, self.links = None, None, {}

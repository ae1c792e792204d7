"""Weight sync to several generation servers in one round (SPEC X5): one transfer group per server.

Each server keeps the group it would have alone (trainer rank 0 + its workers, ``rank_offset`` 1, as
VLLM_PROTOCOL.md's ``init_info`` has it), so the fan-out works unchanged against real vLLM servers and
the embedded one. One round walks the servers together:

    pause all (concurrently) -> barrier -> start all -> post /update_weights to all
    -> every tensor made once and broadcast into each server's group in turn
    -> join all -> finish all -> reset prefix caches -> resume all

so each tensor is gathered or merged once however many servers there are, and every server serves the
new version from the same moment on. Each HTTP step runs on all servers at once; its timeout and its
errors name the server.

A server that stops answering is dropped, by URL, with a warning: before a round (``/health`` fails, or
``/weight_info`` reports other weights than the run pushed, i.e. it restarted), at a step of the round,
or during a gloo broadcast (its ``/update_weights`` call breaks and the broadcast to the others goes
on). The rollout worker hears of it through ``on_drop`` and stops routing there. A server that dies
during an NCCL broadcast stops the run: NCCL cannot abandon a collective whose peer is gone. When no
server is left, the round fails naming every URL.

    sender = FanoutSender(timeout_s=600)
    sender.init([AsyncServerClient(u) for u in urls], world_sizes=[1, 1], backend="gloo", device="cpu")
    timings = sender.update_model(model, version="step-1")
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

import torch

from asyncgrpo.client.errors import ServerError, WeightTransferError
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.weights.collectives import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    TensorMeta,
    TransferGroup,
    dtype_name,
    send_tensors,
)
from asyncgrpo.weights.policy import policy_weight_metadata, policy_weights
from asyncgrpo.weights.sender import DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S, WeightSender

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0  # the /health and /weight_info look before a round


class _FanoutGroup(TransferGroup):
    """Broadcasts into each live server's group in turn; a member whose server died is dropped mid-round."""

    def __init__(self, members: dict[str, TransferGroup], lost: Callable[[str, BaseException], None]) -> None:
        first = next(iter(members.values()))
        self.backend, self.rank, self.device = first.backend, 0, first.device
        self.world_size = 1 + sum(g.world_size - 1 for g in members.values())
        self.members = members
        self._lost = lost  # re-raises unless the server is gone

    def _each(self, fn: Callable[[TransferGroup], None]) -> None:
        for url, group in list(self.members.items()):
            try:
                fn(group)
            except Exception as exc:  # noqa: BLE001 - one member's backend error: _lost re-raises unless it died
                self._lost(url, exc)
                del self.members[url]
        if not self.members:
            raise WeightTransferError("every generation server was lost during the weight broadcast")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self._each(lambda g: g.broadcast(tensor, src))

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        raise NotImplementedError("the fan-out only broadcasts; each member group was warmed up when it formed")

    def synchronize(self, what: str) -> None:
        self._each(lambda g: g.synchronize(what))


class FanoutSender:
    """Rank 0 of one weight-transfer group per generation server; pushes each round to all of them.

    Args:
        timeout_s: bound on every wait of a round (per server and step).
        packed_buffer_size_bytes, packed_num_buffers: as :class:`WeightSender` (sent in each ``init_info``).
        on_drop: called with the server's index (its place in the ``init`` list) when a server is dropped.
    """

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_WEIGHT_TRANSFER_TIMEOUT_S,
        packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
        packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._sender_kwargs = {"timeout_s": timeout_s, "packed_buffer_size_bytes": packed_buffer_size_bytes,
                               "packed_num_buffers": packed_num_buffers, "restart_timeout_s": 0.0}  # fmt: skip
        self.on_drop = on_drop
        self.senders: dict[str, WeightSender] = {}  # live servers by URL, in the config's order
        self.index: dict[str, int] = {}
        self.dropped: dict[str, str] = {}  # URL -> why
        self.packed_buffer_size_bytes = packed_buffer_size_bytes
        self.packed = True
        self.restarts = 0  # WeightSender's field; a dropped server is never re-formed here

    # ------------------------------------------------------------------ set-up

    def init(
        self,
        clients: Sequence[AsyncServerClient],
        world_sizes: Sequence[int | None] | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
        *,
        packed: bool = True,
    ) -> None:
        """Form one group with each server (one after the other: each rendezvous is its own).

        Raises:
            WeightTransferError: a server rejected its init or its rendezvous timed out (named by URL).
        """
        sizes = list(world_sizes) if world_sizes is not None else [None] * len(clients)
        if len(sizes) != len(clients) or not clients:
            raise ValueError(f"need one world size per server: {len(clients)} servers, {len(sizes)} sizes")
        self.packed = packed
        for i, (client, size) in enumerate(zip(clients, sizes)):
            sender = WeightSender(**self._sender_kwargs)
            try:
                sender.init(client, size, backend=backend, device=device, packed=packed)
            except WeightTransferError as exc:
                raise WeightTransferError(f"forming the weight-transfer group with {client.base_url}: {exc}") from exc
            self.senders[client.base_url] = sender
            self.index[client.base_url] = i

    @property
    def urls(self) -> list[str]:
        """The servers still synced."""
        return list(self.senders)

    # ------------------------------------------------------------------ dropping servers

    def _gone(self, url: str) -> bool:
        sender = self.senders[url]
        try:
            return not sender._loop.run(sender._client.health(), HEALTH_TIMEOUT_S + 5, f"GET /health of {url}")
        except WeightTransferError:
            return True

    def _drop(self, url: str, reason: str) -> None:
        sender = self.senders.pop(url)
        self.dropped[url] = reason
        sender.group = None  # never destroy a communicator whose peer is gone (it may wait for it)
        sender.close(shutdown_server_side=False)
        logger.warning("generation server %s dropped from the weight sync (%s): continuing with %d server(s): %s",
                       url, reason, len(self.senders), ", ".join(self.senders) or "none")  # fmt: skip
        if self.on_drop is not None:
            self.on_drop(self.index[url])
        if not self.senders:
            gone = "; ".join(f"{u} ({why})" for u, why in self.dropped.items())
            raise WeightTransferError(f"every generation server is gone: {gone}. Restart them and resume from the "
                                      "last checkpoint")  # fmt: skip

    def _lost(self, url: str, exc: BaseException) -> None:
        """A step failed on ``url``: drop the server if it is gone, else the round fails naming it."""
        if not self._gone(url):
            raise WeightTransferError(f"weight sync to {url} failed: {exc}") from exc
        self._drop(url, f"stopped answering: {exc}")

    def _each(self, make: Callable[[AsyncServerClient], Coroutine[Any, Any, Any]], what: str) -> None:
        """Run one HTTP step on every live server at once; wait for all (each bounded, named on timeout)."""
        futures = {url: s._loop.submit(make(s._client)) for url, s in self.senders.items()}
        deadline = time.monotonic() + self.timeout_s
        for url, fut in futures.items():
            try:
                fut.result(max(deadline - time.monotonic(), 0.0))
            except concurrent.futures.TimeoutError:
                fut.cancel()
                self._lost(url, WeightTransferError(f"timed out after {self.timeout_s:.0f}s waiting for {what}"))
            except (ServerError, OSError) as exc:
                self._lost(url, exc)

    def _check_before_round(self) -> None:
        """Drop servers that stopped answering, or restarted (other weights than the run pushed them)."""
        for url in list(self.senders):
            sender = self.senders[url]
            call = sender._client.request("GET", "/weight_info", retries=0, timeout=HEALTH_TIMEOUT_S)
            try:
                info = sender._loop.run(call, HEALTH_TIMEOUT_S + 5, f"GET /weight_info of {url}")
            except (ServerError, WeightTransferError) as exc:
                if isinstance(exc, ServerError) and exc.status not in (None, 503):
                    continue  # it answers (a real vLLM outside dev mode has no /weight_info)
                self._drop(url, f"no answer before the weight sync: {exc}")
                continue
            version = info.get("weight_version") if isinstance(info, dict) else None
            pushed = sender._pushed_version
            if pushed is not None and version != pushed:
                self._drop(url, f"it restarted: it serves weight version {version!r}, not {pushed!r} pushed last")

    # ------------------------------------------------------------------ one round

    def update(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: str,
        metadata: Sequence[TensorMeta] | None = None,
        barrier: Callable[[], None] | None = None,
    ) -> dict[str, float]:
        """Push one set of weights to every live server and label it ``version`` (see the module docstring).

        Returns:
            ``{"pause_s", "barrier_s", "transfer_s", "total_s"}`` as :meth:`WeightSender.update`.
        """
        items = None if metadata is not None else list(named_tensors)
        metas = list(metadata) if metadata is not None else [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in items]
        tensors = (t for _, t in (items if items is not None else named_tensors))
        self._check_before_round()
        t0 = time.perf_counter()
        try:
            self._each(lambda c: c.pause("keep", timeout=self.timeout_s), "POST /pause?mode=keep")
            t1 = time.perf_counter()
            if barrier is not None:
                barrier()
            self._each(lambda c: c.start_weight_update(timeout=self.timeout_s), "POST /start_weight_update")
        except BaseException:
            self._resume_quietly()
            raise
        t2 = time.perf_counter()
        futures = {}
        for url, s in self.senders.items():
            reuse = metas == s._last_metas
            info = {"names": [] if reuse else [m.name for m in metas],
                    "dtype_names": [] if reuse else [dtype_name(m.dtype) for m in metas],
                    "shapes": [] if reuse else [list(m.shape) for m in metas]}  # fmt: skip
            futures[url] = s._loop.submit(s._client.update_weights(info, timeout=self.timeout_s))
            s.group.abort_check = _raise_if_failed(futures[url], url)
        self._broadcast(tensors, metas, futures)
        for url, s in list(self.senders.items()):
            s._last_metas = metas
        self._each(lambda c: c.finish_weight_update(version, timeout=self.timeout_s), "POST /finish_weight_update")
        for s in self.senders.values():
            s._pushed_version = str(version)
        self._each(lambda c: c.reset_prefix_cache(), "POST /reset_prefix_cache")
        self._each(lambda c: c.resume(timeout=self.timeout_s), "POST /resume")
        t3 = time.perf_counter()
        return {"pause_s": t1 - t0, "barrier_s": t2 - t1, "transfer_s": t3 - t2, "total_s": t3 - t0}

    def _broadcast(self, tensors: Iterable[torch.Tensor], metas: list[TensorMeta], futures: dict) -> None:
        """Every tensor once, into each live server's group; then wait for each server's ``/update_weights``."""
        nccl = next(iter(self.senders.values())).backend == "nccl"

        def lost(url: str, exc: BaseException) -> None:
            if nccl and self._gone(url):  # the stream holds a collective with a dead peer: nothing can follow
                raise WeightTransferError(f"generation server {url} died during the NCCL weight broadcast; NCCL "
                                          "cannot abandon it. Restart the servers and resume from the last "
                                          "checkpoint") from exc  # fmt: skip
            self._lost(url, exc)

        group = _FanoutGroup({url: s.group for url, s in self.senders.items()}, lost)
        try:
            send_tensors(group, tensors, metas, packed=self.packed, buffer_size_bytes=self.packed_buffer_size_bytes)
            group.synchronize("the weight broadcast")
        finally:
            for s in self.senders.values():
                if s.group is not None:
                    s.group.abort_check = None
        deadline = time.monotonic() + self.timeout_s
        for url in list(self.senders):
            try:
                futures[url].result(max(deadline - time.monotonic(), 0.0))
            except concurrent.futures.TimeoutError:
                self._lost(url, WeightTransferError("the broadcast finished but POST /update_weights did not return"))
            except (ServerError, OSError) as exc:
                self._lost(url, exc)

    def _resume_quietly(self) -> None:
        """After a failed start of a round, leave no live server paused (errors only logged)."""
        for url, s in self.senders.items():
            try:
                s._loop.run(s._client.resume(timeout=30.0), 35.0, f"POST /resume of {url}")
            except (ServerError, WeightTransferError) as exc:
                logger.warning("could not resume %s after a failed weight sync: %s", url, exc)

    def update_model(self, model: torch.nn.Module, *, version: str, **kwargs: Any) -> dict[str, float]:
        """:meth:`update` with ``model``'s policy weights, made one full tensor at a time (as WeightSender's)."""
        return self.update(policy_weights(model), version=version, metadata=policy_weight_metadata(model), **kwargs)

    def close(self) -> None:
        """Leave every group (asking each live server to drop its side)."""
        for sender in self.senders.values():
            sender.close()
        self.senders = {}


def _raise_if_failed(fut: concurrent.futures.Future, url: str) -> Callable[[], None]:
    def check() -> None:
        if fut.done() and fut.exception() is not None:
            raise WeightTransferError(f"POST /update_weights failed on {url}: {fut.exception()}") from fut.exception()

    return check

"""Several generation servers behind one client (SPEC X5): least-loaded routing, failover, per-server figures.

The rollout worker routes each GRPO *group* to one server (the least loaded when the group starts), so the
G requests of a prompt meet on one server (its prefix cache can share the prompt) and every turn of a
multi-turn rollout stays there too. Load is the number of rollouts assigned to a server and not finished;
ties go to the server with the lower KV-cache use (read from ``/metrics`` by the worker's poller).

A server that stops answering (no HTTP answer, and ``/health`` fails too) is reported by its URL and
dropped: the request that found it dead, and every later request routed to it, go to the least loaded
live server instead. With one server nothing changes: its errors reach the caller exactly as before.
When the last server is gone, :class:`AllServersGoneError` names every URL and why it was dropped.

    pool = ServerPool(["http://a:8000", "http://b:8000"], timeout=600, max_connections=64)
    i = pool.assign(4)                        # a group of 4 rollouts goes to server i
    res = await pool.call(i, lambda c: c.complete(ids, params))
    pool.finish(i)                            # once per rollout of the group
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from asyncgrpo.client.answer_parse import AnswerParsers
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class AllServersGoneError(RuntimeError):
    """Every generation server of the run stopped answering."""


@dataclass
class ServerStats:
    """Running figures of one server, read (and the counters reset) by the worker's metrics poll."""

    requests: int = 0  # HTTP generation calls started since the last poll
    errors: int = 0  # calls that raised since the last poll
    outstanding: int = 0  # calls in flight now
    assigned: int = 0  # rollouts routed here and not finished (the routing load)
    kv_usage: float = 0.0  # last /metrics KV-cache use (0..1), the routing tie-break
    dead_reason: str | None = None  # why it was dropped; None while it serves

    @property
    def alive(self) -> bool:
        return self.dead_reason is None


class ServerPool:
    """Clients of several servers with least-loaded routing and failover (one event loop, like the clients).

    Args:
        base_urls: the servers, in the config's order (their index names them in metrics).
        timeout: one HTTP call's timeout.
        max_connections: connection pool size of each client (the run's concurrency bound).
        retry_for_s: with one server, how long a server that stopped answering is retried (restart survival);
            with several, unused: a silent server is dropped after the client's few retries and its work
            moves to the others.
        answer_parsers: helpers every client hands large answers to (the caller owns and closes them).
        timeout_name: the config field ``timeout`` comes from; a request past it fails at once, naming it
            (``HttpTransport``). The rollout loop's requests: ``request_timeout``.
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        *,
        timeout: float,
        max_connections: int,
        retry_for_s: float = 0.0,
        answer_parsers: AnswerParsers | None = None,
        timeout_name: str | None = "request_timeout",
    ) -> None:
        if not base_urls:
            raise ValueError("ServerPool needs at least one server URL")
        retry = 0.0 if len(base_urls) > 1 else retry_for_s
        self.clients = [
            AsyncServerClient(
                url,
                timeout=timeout,
                max_connections=max_connections,
                retry_for_s=retry,
                answer_parsers=answer_parsers,
                timeout_name=timeout_name,
            )
            for url in base_urls
        ]
        self.stats = [ServerStats() for _ in base_urls]

    @property
    def urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    def __len__(self) -> int:
        return len(self.clients)

    def alive(self) -> list[int]:
        """Indices of the servers still in use."""
        return [i for i, s in enumerate(self.stats) if s.alive]

    def least_loaded(self) -> int:
        """The live server with the fewest assigned rollouts (then the lowest KV use, then the lowest index).

        Raises:
            AllServersGoneError: no server is left.
        """
        live = self.alive()
        if not live:
            gone = "; ".join(f"{c.base_url} ({s.dead_reason})" for c, s in zip(self.clients, self.stats))
            raise AllServersGoneError(
                f"every generation server stopped answering: {gone}. Restart them and resume from the last checkpoint"
            )
        return min(live, key=lambda i: (self.stats[i].assigned, self.stats[i].kv_usage, i))

    def assign(self, n: int) -> int:
        """Route ``n`` rollouts (a group) to the least loaded server; call :meth:`finish` once per rollout."""
        i = self.least_loaded()
        self.stats[i].assigned += n
        return i

    def finish(self, i: int) -> None:
        self.stats[i].assigned -= 1

    def client(self, i: int | None = None) -> AsyncServerClient:
        """Server ``i``'s client if it is alive, else the least loaded live server's."""
        if i is None or not self.stats[i].alive:
            i = self.least_loaded()
        return self.clients[i]

    async def call(self, i: int, fn: Callable[[AsyncServerClient], Awaitable[_T]]) -> _T:
        """``fn(client)`` on server ``i``, or on another live server when ``i`` is dead or dies during the call.

        Raises:
            ServerError: the server answered with an error (the request is at fault, not the server), or the
                only server did not answer.
            AllServersGoneError: the last live server stopped answering.
        """
        while True:
            if not self.stats[i].alive:
                i = self.least_loaded()
            stats = self.stats[i]
            stats.requests += 1
            stats.outstanding += 1
            try:
                return await fn(self.clients[i])
            except ServerError as exc:
                stats.errors += 1
                if len(self.clients) == 1 or exc.status is not None or await self.clients[i].health():
                    raise
                self.mark_dead(i, f"no answer to {exc.endpoint}: {exc.message}")
            finally:
                stats.outstanding -= 1

    def mark_dead(self, i: int, reason: str) -> None:
        """Stop routing to server ``i`` (logged once, naming its URL)."""
        if not self.stats[i].alive:
            return
        self.stats[i].dead_reason = reason
        left = [self.clients[j].base_url for j in self.alive()]
        logger.warning(
            "generation server %s stopped answering (%s): continuing on the other %d (%s); its rollouts in flight "
            "are retried there",
            self.clients[i].base_url, reason, len(left), ", ".join(left) or "none",
        )  # fmt: skip

    def drop_flagged(self, mask: int) -> None:
        """Stop routing to every server whose bit is set in ``mask`` (the trainer dropped it from the weight sync)."""
        for i, stats in enumerate(self.stats):
            if mask >> i & 1 and stats.alive:
                self.mark_dead(i, "the trainer dropped it from the weight sync")

    async def close(self) -> None:
        for c in self.clients:
            await c.close()

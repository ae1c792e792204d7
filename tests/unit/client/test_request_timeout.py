"""request_timeout: a server that accepts the connection but never answers fails the request within the timeout,
naming it, instead of being retried (a real listening socket that never writes)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.client.pool import ServerPool
from asyncgrpo.errors import ServerTimeoutError


@pytest.fixture
def silent_server():
    """A TCP server that accepts connections and reads requests but never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", conns
    stop.set()
    thread.join(2)
    for c in [*conns, sock]:
        c.close()


def test_a_generation_request_fails_within_request_timeout_naming_it(silent_server):
    url, conns = silent_server
    pool = ServerPool([url], timeout=0.6, max_connections=2, retry_for_s=120.0)  # restart window: not for timeouts

    async def call() -> None:
        try:
            await pool.call(0, lambda c: c.complete_n([1, 2, 3], {"max_tokens": 4}, model="m"))
        finally:
            await pool.close()

    t0 = time.monotonic()
    with pytest.raises(ServerTimeoutError, match=r"request_timeout=0\.6") as info:
        asyncio.run(call())
    elapsed = time.monotonic() - t0
    assert 0.6 <= elapsed < 3.0, elapsed  # one attempt, not retried for 120 s
    assert "POST /v1/completions" in str(info.value) and url in str(info.value)
    assert len(conns) == 1 and pool.clients[0].retry_count == 0


def test_without_a_timeout_name_a_timeout_is_retried_as_before(silent_server):
    url, conns = silent_server
    client = AsyncServerClient(url, timeout=0.3, retries=1, backoff=0.0)

    async def call() -> None:
        try:
            await client.request("GET", "/v1/models")
        finally:
            await client.close()

    start = time.monotonic()
    with pytest.raises(ServerTimeoutError, match="no answer within"):
        asyncio.run(call())
    # two attempts, each waited out its 0.3 s (whether aiohttp opens a second connection for the retry is its own
    # business: 3.9 may not have accepted it yet when the second attempt times out)
    assert client.retry_count == 1 and len(conns) >= 1 and time.monotonic() - start >= 0.6

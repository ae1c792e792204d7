"""ServerPool (X5): least-loaded routing of groups, and what happens when servers stop answering.

The dead servers here are real: URLs of closed local ports, so every call gets a real refused connection.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from asyncgrpo.client.pool import AllServersGoneError, ServerPool
from asyncgrpo.errors import ServerError
from asyncgrpo.server.launcher import free_port


def _pool(n: int) -> ServerPool:
    return ServerPool([f"http://127.0.0.1:{free_port()}" for _ in range(n)], timeout=5, max_connections=4)


def test_groups_go_to_the_least_loaded_server_and_come_back_when_done():
    pool = _pool(3)
    assert [pool.assign(4) for _ in range(3)] == [0, 1, 2]  # all idle: in order
    pool.finish(1)
    assert pool.assign(2) == 1  # server 1 has 3 rollouts left, the others 4
    assert [s.assigned for s in pool.stats] == [4, 5, 4]
    pool.stats[2].kv_usage = 0.1
    pool.stats[0].kv_usage = 0.5
    assert pool.least_loaded() == 2  # a tie on load goes to the emptier KV cache
    pool.drop_flagged(0b100)
    assert pool.alive() == [0, 1] and pool.least_loaded() == 0
    assert pool.client(2) is pool.clients[0]  # a dead server's rollouts use a live one


def test_a_dead_server_is_dropped_by_url_and_the_last_one_stops_with_every_url(caplog):
    pool = _pool(2)
    for c in pool.clients:
        c.retries = 0

    async def health_of_first(client):
        return await client.request("GET", "/health", retries=0, parse="none")

    with caplog.at_level(logging.WARNING), pytest.raises(AllServersGoneError) as err:
        asyncio.run(pool.call(0, health_of_first))
    for url in pool.urls:
        assert url in str(err.value)
    assert pool.alive() == []
    assert [s.errors for s in pool.stats] == [1, 1] and [s.requests for s in pool.stats] == [1, 1]
    assert any(pool.urls[0] in r.getMessage() and "continuing on the other 1" in r.getMessage() for r in caplog.records)


def test_one_server_keeps_its_errors_as_before():
    pool = _pool(1)
    pool.clients[0].retries = 0

    async def models(client):
        return await client.models()

    with pytest.raises(ServerError, match="no answer"):
        asyncio.run(pool.call(0, models))
    assert pool.alive() == [0]  # never dropped: the single-server run keeps its restart handling

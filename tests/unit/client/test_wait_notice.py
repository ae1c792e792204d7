"""The notice of a wait for a server's /health names the bound that really ends the wait (issue 44 item 4).

Before, a URL where nothing listens gave up after vllm_server_connect_timeout (60 s) while the notice at 30 s said
"timeout 1800s" (vllm_server_timeout). Real sockets here: a port nobody listens on, and an aiohttp server that is
up but not ready (503).
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import time

import pytest
from aiohttp import web

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerTimeoutError

NOTICE = re.compile(r"not answering /health for (\d+)s \(gives up in (\d+)s more(.*?), at (\d+)s in all")


def _notices(caplog) -> list[tuple[int, int, str, int]]:
    found = [NOTICE.search(r.getMessage()) for r in caplog.records if r.levelno == logging.WARNING]
    return [(int(m[1]), int(m[2]), m[3], int(m[4])) for m in found if m]


def test_nothing_listening_notice_names_the_connect_bound(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: every connection is refused

    async def main():
        async with AsyncServerClient(f"http://127.0.0.1:{port}", retries=0) as client:
            await client.wait_until_ready(timeout=1800, poll_s=0.05, log_every=1.0, refused_timeout=2.5)

    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(ServerTimeoutError, match="nothing listens"):
        asyncio.run(main())
    assert time.monotonic() - t0 < 10
    notices = _notices(caplog)
    assert notices, [r.getMessage() for r in caplog.records]
    for waited, remaining, refused_part, total in notices:
        assert "every connection stays refused" in refused_part and "vllm_server_connect_timeout=2.5" in refused_part
        assert abs(waited + remaining - 2.5) <= 1  # the remaining connect bound, not the 1800 s one
        assert total == 1800


def test_a_server_that_is_up_but_not_ready_gets_the_whole_timeout(caplog):
    async def health(request):
        return web.json_response({"error": {"message": "loading", "code": 503}}, status=503)

    async def main():
        app = web.Application()
        app.add_routes([web.get("/health", health)])
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            async with AsyncServerClient(url, retries=0) as client:
                await client.wait_until_ready(timeout=3.0, poll_s=0.05, log_every=1.0, refused_timeout=1.0)
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.WARNING), pytest.raises(ServerTimeoutError, match="not ready after"):
        asyncio.run(main())
    notices = _notices(caplog)
    assert notices, [r.getMessage() for r in caplog.records]
    for waited, remaining, refused_part, total in notices:
        assert refused_part == "" and total == 3  # answered (503), so the connect bound no longer applies
        assert abs(waited + remaining - 3) <= 1

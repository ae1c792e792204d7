"""A real aiohttp server in a thread of its own, for tests whose code under test runs its own event loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Self

from aiohttp import web


class ThreadedServer:
    """Serve ``routes`` on 127.0.0.1 (a free port) from a background thread; ``url`` once entered."""

    def __init__(self, routes: list[web.RouteDef]):
        self.routes = routes
        self.loop = asyncio.new_event_loop()
        self.url = ""

    async def _start(self) -> None:
        app = web.Application()
        app.add_routes(self.routes)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    def __enter__(self) -> Self:
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-http-server", daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

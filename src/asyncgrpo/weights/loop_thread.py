"""An asyncio loop on a thread for synchronous callers of the async HTTP client (the weight senders)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar
from urllib.parse import urlparse

from asyncgrpo.errors import WeightTransferError

_T = TypeVar("_T")


class LoopThread:
    """An asyncio loop on a daemon thread, so synchronous trainer code can run the async client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="asyncgrpo-weight-sync-http", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, _T], timeout: float, what: str) -> _T:
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise WeightTransferError(f"timed out after {timeout:.0f}s waiting for {what}") from None

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5.0)
        if not self.loop.is_running():
            self.loop.close()


def local_address_towards(base_url: str) -> str:
    """The address of this machine on the route to the server (the gloo store master must be reachable)."""
    parsed = urlparse(base_url)
    host = parsed.hostname or "127.0.0.1"
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, parsed.port or 80))  # UDP connect sends nothing; it only picks the route
        return s.getsockname()[0]

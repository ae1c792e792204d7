"""The HTTP plumbing under ``AsyncServerClient`` (``http_client.py``): one session per event loop, and one call
with status checking and retries.

Every call checks the HTTP status and raises :class:`ServerError` naming the endpoint, the status and the
server's message; connection errors, timeouts and 503 are retried with exponential backoff (``retry_count``
counts the retries for the ``rollout/vllm_retry_count`` metric). The endpoints themselves are methods of
``AsyncServerClient``; this file knows no endpoint but the status explanations of ``server_rules.explain``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, Self
from urllib.parse import urlparse

import aiohttp
from aiohttp.payload import BytesPayload

from asyncgrpo import json_codec
from asyncgrpo.client.answer_parse import AnswerParsers
from asyncgrpo.client.results import error_message
from asyncgrpo.client.server_rules import explain
from asyncgrpo.errors import ServerError, ServerTimeoutError

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0  # one HTTP call (a long generation must fit)
JSON_TYPE = "application/json"  # the Content-Type of every request body


class HttpTransport:
    """Connection pool, timeouts and retried calls to one server, bound to the event loop it is first used in.

    Args:
        base_url: e.g. ``http://localhost:8000``.
        timeout: seconds for one HTTP call unless the method takes its own ``timeout``.
        max_connections: HTTP connection pool size (SPEC G6).
        retries: extra attempts after a connection error, a timeout or a 503.
        backoff: first retry delay in seconds; doubles each retry (capped at 30 s).
        retry_for_s: keep retrying a call that gets no answer (or 503) until this many seconds passed since its
            first attempt, even past ``retries`` (a server restarting); 0 = only ``retries`` count.
        answer_parsers: helper processes that parse large generation answers off the event loop (shared between
            clients of one loop; their owner closes them); None parses every answer inline.
        timeout_name: the config field that set ``timeout`` (e.g. ``request_timeout``). When given, a call that runs
            past ``timeout`` is not retried: it raises at once, naming the field (a server that holds a request that
            long is hung, and retrying would only multiply the wait). None: timeouts are retried like lost connections.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        max_connections: int = 512,
        retries: int = 3,
        backoff: float = 0.5,
        retry_for_s: float = 0.0,
        answer_parsers: AnswerParsers | None = None,
        timeout_name: str | None = None,
    ) -> None:
        parsed = urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"base_url {base_url!r} is not an http(s) URL; pass e.g. 'http://localhost:8000'")
        if retries < 0 or backoff < 0 or timeout <= 0 or max_connections < 1:
            raise ValueError(
                f"need retries >= 0, backoff >= 0, timeout > 0, max_connections >= 1; got {retries}, {backoff}, "
                f"{timeout}, {max_connections}"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.max_connections = max_connections
        self.retries = retries
        self.backoff = backoff
        self.retry_for_s = max(float(retry_for_s), 0.0)
        self.retry_count = 0
        self.parse_seconds = 0.0  # diagnostics: event-loop time spent decoding JSON answers and parsing choices
        self.answer_parsers = answer_parsers
        self.timeout_name = timeout_name
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and self._loop is not loop:
            raise RuntimeError(
                "this AsyncServerClient is bound to another event loop; use client.clone() in each loop/thread"
            )
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections)
            self._session = aiohttp.ClientSession(connector=connector)
            self._loop = loop
        return self._session

    def _client_timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        """aiohttp's (immutable) timeout record for ``seconds``, made once per value rather than per request."""
        timeout = self._timeouts.get(seconds)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=seconds)
            if len(self._timeouts) < 64:  # callers use a few fixed values; one counting down is not kept
                self._timeouts[seconds] = timeout
        return timeout

    async def close(self) -> None:
        """Close the connection pool."""
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
        retries: int | None = None,
        parse: str = "json",
    ) -> Any:
        """One HTTP call with status checking and retries; returns parsed JSON, text (``parse="text"``) or None.

        Raises:
            ServerError: an error status (4xx, 5xx, or 503 after the retries), or no answer after the retries.
            ServerTimeoutError: the last attempt timed out.
        """
        endpoint = f"{method} {path}"
        attempts = 1 + (self.retries if retries is None else retries)
        limit = self.timeout if timeout is None else timeout
        session = self._get_session()
        last: ServerError | None = None
        t0 = time.monotonic()
        window = self.retry_for_s if retries is None else 0.0
        # Encoded once (orjson, when installed: aiohttp's own json= path runs the standard library's encoder, a
        # tenth of the worker's time per request), sent again unchanged by every retry.
        data = None if json_body is None else json_codec.dumps(json_body)
        attempt = 0
        while attempt < attempts or (attempt and time.monotonic() - t0 < window):
            if attempt:
                self.retry_count += 1
                delay = min(self.backoff * 2 ** (attempt - 1), 30.0 if attempt < attempts else 2.0)
                delay = min(delay, max(window - (time.monotonic() - t0), 0.0)) if attempt >= attempts else delay
                if attempt < attempts or attempt % 10 == 0:
                    logger.warning("retrying %s at %s in %.1fs (%.0fs since the first try, retrying for up to %.0fs) "
                                   "after: %s", endpoint, self.base_url, delay, time.monotonic() - t0,
                                   max(window, 0.0), last)  # fmt: skip
                await asyncio.sleep(delay)
            attempt += 1
            try:
                async with session.request(
                    method,
                    self.base_url + path,
                    data=None if data is None else BytesPayload(data, content_type=JSON_TYPE),
                    params=params,
                    timeout=self._client_timeout(limit),
                ) as resp:
                    body = await resp.read()
                    status = resp.status
            except TimeoutError:
                if self.timeout_name is not None and timeout is None:  # the named bound is the caller's whole wait
                    raise ServerTimeoutError(endpoint, None, f"no answer within {limit:g}s ({self.timeout_name}="
                                             f"{limit:g}); the server holds the request: it may be hung or overloaded. "
                                             f"Raise {self.timeout_name} if its answers are just slow",
                                             base_url=self.base_url) from None  # fmt: skip
                last = ServerTimeoutError(endpoint, None, f"no answer within {limit:.0f}s", base_url=self.base_url)
                continue
            except aiohttp.ClientError as exc:
                refused = isinstance(exc, aiohttp.ClientConnectorError)
                last = ServerError(endpoint, None, f"{type(exc).__name__}: {exc}", base_url=self.base_url,
                                   refused=refused)  # fmt: skip
                continue
            if status >= 400:
                message = explain(path, status, error_message(body))
                last = ServerError(endpoint, status, message, base_url=self.base_url)
                if status == 503:
                    continue
                raise last
            if parse == "json":
                t_parse = time.perf_counter()
                try:
                    return json_codec.loads(body) if body else None
                except ValueError as exc:
                    raise ServerError(endpoint, status, f"answer is not JSON: {body[:200]!r}") from exc
                finally:
                    self.parse_seconds += time.perf_counter() - t_parse
            if parse == "text":
                return body.decode("utf-8", errors="replace")
            if parse == "bytes":
                return body
            return None
        assert last is not None
        if window > 0 and last.status is None:
            since = time.strftime("%H:%M:%S", time.localtime(time.time() - (time.monotonic() - t0)))
            raise ServerError(endpoint, None, f"server {self.base_url} gone since {since} ({time.monotonic() - t0:.0f}s; "
                              f"retried for up to {window:.0f}s, vllm_server_restart_timeout): {last.message}",
                              base_url=self.base_url)  # fmt: skip
        raise last

"""Surviving a generation-server restart during a run (issue 9, X4): the sender's side.

Before each round the sender asks the server which weights it serves. No answer, or
other weights than it pushed last, means the server went away or restarted: the
sender waits for it (bounded by ``restart_timeout_s``, a line every 30 s), forms the
weight-transfer group again and the round pushes the current weights. A round that
fails because the server vanished mid-way is repeated once the same way. If the
server does not come back, the run stops with "server ... gone since ...".
"""

from __future__ import annotations

import logging
import time
from typing import Any

from asyncgrpo.errors import ServerError, WeightTransferError

logger = logging.getLogger(__name__)

DEFAULT_RESTART_TIMEOUT_S = 120.0  # how long a round waits for a vanished server to come back
RESTART_POLL_S = 0.5
RESTART_LOG_INTERVAL_S = 30.0  # X4


class RestartRecovery:
    """Mixed into ``WeightSender``: uses its ``_client``, ``_loop``, ``_http``, ``init`` and ``close``."""

    restart_timeout_s: float = DEFAULT_RESTART_TIMEOUT_S
    restarts: int = 0  # times the group was formed again after the server came back
    _pushed_version: str | None = None  # the version the last finished round labelled
    _init_kwargs: dict[str, Any] | None = None  # init()'s arguments, to form the group again
    _client: Any
    _loop: Any
    # WeightSender provides _http(coro, what), init(**kwargs) and close(shutdown_server_side=...).

    def _ensure_server(self) -> None:
        """Before a round: if the server stopped answering, or answers with other weights than we pushed last (it
        restarted), wait for it (bounded) and form the group again; the round then pushes the current weights."""
        assert self._client is not None
        try:
            info = self._http(self._client.request("GET", "/weight_info", retries=0, timeout=30.0), "GET /weight_info")
        except ServerError as exc:
            if exc.status is not None and exc.status != 503:
                return  # it answers (e.g. a real vLLM without /weight_info): nothing to compare
            info = None
        except WeightTransferError:
            info = None
        if info is not None:
            version = info.get("weight_version") if isinstance(info, dict) else None
            if self._pushed_version is None or version == self._pushed_version:
                return
            logger.warning("server %s serves weight version %r, not %r pushed last: it restarted", self._client.base_url,
                           version, self._pushed_version)  # fmt: skip
        else:
            self._await_return()
        self._reinit()

    def _server_vanished(self, exc: BaseException) -> bool:
        """A failed round is worth repeating: restarts are allowed and the server does not answer /health now."""
        if self.restart_timeout_s <= 0 or self._client is None or self._loop is None:
            return False
        if self._http(self._client.health(), "GET /health"):
            return False
        logger.warning("the weight sync failed because server %s stopped answering (%s)", self._client.base_url, exc)
        return True

    def _await_return(self) -> None:
        assert self._client is not None
        url, t0, since = self._client.base_url, time.monotonic(), time.strftime("%H:%M:%S")
        next_log = t0
        while True:
            if self._http(self._client.health(), "GET /health"):
                return
            waited = time.monotonic() - t0
            if waited >= self.restart_timeout_s:
                raise WeightTransferError(
                    f"server {url} gone since {since} ({waited:.0f}s; it did not come back within "
                    f"restart_timeout {self.restart_timeout_s:.0f}s). Restart `asyncgrpo serve` on that address and "
                    "resume from the last checkpoint"
                )
            if time.monotonic() >= next_log:
                logger.warning("server %s gone since %s (%.0fs so far): waiting up to %.0fs for it to come back",
                               url, since, waited, self.restart_timeout_s)  # fmt: skip
                next_log = time.monotonic() + RESTART_LOG_INTERVAL_S
            time.sleep(RESTART_POLL_S)

    def _reinit(self) -> None:
        """The server came back without our group (or with other weights): leave the old group, form a new one."""
        assert self._init_kwargs is not None
        kwargs = dict(self._init_kwargs)
        self.close(shutdown_server_side=False)
        self.init(**kwargs)
        self.restarts += 1
        logger.warning("weight transfer re-established with %s (restart %d): pushing the current weights",
                       kwargs["client"].base_url, self.restarts)  # fmt: skip

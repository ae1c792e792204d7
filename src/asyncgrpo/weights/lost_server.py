"""What the weight sender does about a generation server that stops answering or restarts: its two policies.

Both look the same way before each round: ``GET /weight_info`` without retries. No answer (or a 503), or other
weights than the run pushed last, means the server went away or restarted. A server that answers with another
error status (a real vLLM outside dev mode has no ``/weight_info``) is taken as it is.

* :class:`RestartRecovery` (one server, issue 9, X4): wait for it (bounded by ``restart_timeout_s``, a line every
  30 s), form the weight-transfer group again, and the round pushes the current weights. A round that fails
  because the server vanished mid-way is repeated once the same way. If the server does not come back, the run
  stops with "server ... gone since ...".
* :class:`DropDeadServers` (several servers, X5): drop it by URL with a warning and go on with the rest (the
  rollout worker hears of it through the sender's ``on_drop``), whether found before a round, at an HTTP step, or
  (``per_server`` over gloo) during the broadcast. A failed step on a server that still answers fails the round
  and closes it on every live server. When no server is left the round fails naming every URL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from asyncgrpo.errors import ServerError, WeightTransferError

if TYPE_CHECKING:
    from asyncgrpo.weights.links import Sender, ServerLink

logger = logging.getLogger(__name__)

DEFAULT_RESTART_TIMEOUT_S = 120.0  # how long a round waits for a vanished server to come back
RESTART_POLL_S = 0.5
RESTART_LOG_INTERVAL_S = 30.0  # X4
_T = TypeVar("_T")


def missing_reason(sender: Sender, link: ServerLink, timeout_s: float) -> tuple[str, bool] | None:
    """Why ``link``'s server is not the one the run pushed to, and whether it answers (it restarted), or None."""
    call = link.client.request("GET", "/weight_info", retries=0, timeout=timeout_s)
    try:
        info = sender._loop_run(call, timeout_s + 5, f"GET /weight_info of {link.url}")
    except ServerError as exc:
        if exc.status is not None and exc.status != 503:
            return None  # it answers (e.g. a real vLLM without /weight_info): nothing to compare
        return f"no answer before the weight sync: {exc}", False
    except WeightTransferError as exc:
        return f"no answer before the weight sync: {exc}", False
    version = info.get("weight_version") if isinstance(info, dict) else None
    pushed = sender.pushed.get(link.url)
    if pushed is None or version == pushed:
        return None
    return f"it restarted: it serves weight version {version!r}, not {pushed!r} pushed last", True


class RestartRecovery:
    """Wait for a vanished server, form the group again and push (one server; see the module docstring).

    ``closes_failed_pause_and_resume`` is False: a pause or resume that fails is left to the restart check (the
    server either vanished, and is waited for, or answered an error and stays as it was).
    """

    closes_failed_pause_and_resume = False
    check_timeout_s = 30.0

    def __init__(self, restart_timeout_s: float = DEFAULT_RESTART_TIMEOUT_S) -> None:
        if restart_timeout_s < 0:
            raise ValueError(f"restart_timeout_s must be >= 0, got {restart_timeout_s}")
        self.restart_timeout_s = restart_timeout_s

    def before_round(self, sender: Sender) -> None:
        """A server that stopped answering, or restarted, is waited for (bounded) and the group formed again."""
        link = next(iter(sender.links.values()))
        missing = missing_reason(sender, link, self.check_timeout_s)
        if missing is None:
            return
        reason, answers = missing
        if answers:
            logger.warning("server %s: %s", link.url, reason)
        else:
            self._await_return(sender, link.url)
        self._reinit(sender)

    def lost(self, sender: Sender, link: ServerLink, exc: BaseException) -> None:
        """A step failed: the round fails with the step's own error; :meth:`run` decides on a repeat."""
        raise exc

    def run(self, sender: Sender, once: Callable[[], _T], replayable: bool) -> _T:
        """``once()``, repeated once after the server came back when it failed because the server vanished."""
        try:
            return once()
        except (WeightTransferError, ServerError) as exc:
            if not replayable or not self._vanished(sender, exc):
                raise
        self._await_return(sender, next(iter(sender.links)))
        self._reinit(sender)
        return once()

    def _vanished(self, sender: Sender, exc: BaseException) -> bool:
        """Restarts are allowed and the server does not answer /health now."""
        if self.restart_timeout_s <= 0 or not sender.links:
            return False
        link = next(iter(sender.links.values()))
        if sender._http(link.client.health(), "GET /health"):
            return False
        logger.warning("the weight sync failed because server %s stopped answering (%s)", link.url, exc)
        return True

    def _await_return(self, sender: Sender, url: str) -> None:
        link = sender.links[url]
        t0, since = time.monotonic(), time.strftime("%H:%M:%S")
        next_log = t0
        while True:
            if sender._http(link.client.health(), "GET /health"):
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

    def _reinit(self, sender: Sender) -> None:
        """The server came back without our group (or with other weights): leave the old group, form a new one."""
        sender.reform()
        sender.restarts += 1
        logger.warning("weight transfer re-established with %s (restart %d): pushing the current weights",
                       ", ".join(sender.links), sender.restarts)  # fmt: skip


class DropDeadServers:
    """Drop a server that stopped answering and go on with the rest (several servers; see the module docstring).

    ``closes_failed_pause_and_resume`` is True: whatever step fails, every live server's round is closed.
    """

    closes_failed_pause_and_resume = True
    check_timeout_s = 10.0  # the /weight_info look before a round

    def before_round(self, sender: Sender) -> None:
        """Drop servers that stopped answering or restarted; with ``shared``, re-form the group without them."""
        before = len(sender.links)
        for url, link in list(sender.links.items()):
            missing = missing_reason(sender, link, self.check_timeout_s)
            if missing is not None:
                sender.drop(url, missing[0])
        if sender.shared is not None and len(sender.links) < before:
            sender.reform_shared()

    def lost(self, sender: Sender, link: ServerLink, exc: BaseException) -> None:
        """Drop the server if it stopped answering, else fail the round naming it."""
        if link.url not in sender.links:
            return
        if not sender.gone(link.url):
            raise WeightTransferError(f"weight sync to {link.url} failed: {exc}") from exc
        sender.drop(link.url, f"stopped answering: {exc}")

    def run(self, sender: Sender, once: Callable[[], _T], replayable: bool) -> _T:
        """A dropped server is never taken back, so a round is never repeated."""
        return once()


LostServerPolicy = RestartRecovery | DropDeadServers

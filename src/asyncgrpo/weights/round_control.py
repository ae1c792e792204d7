"""The HTTP steps of one weight round on one server, and the rule that a failed round never leaves it paused.

A real vLLM answers every worker-side weight-transfer error with a 500 (update without start, a second start,
an unknown name found while loading, ...), and a start before init with a 200 whose failure comes at
``/update_weights`` (docs/protocol.md). So the status says nothing about whether the server entered the
collective: what matters is whether it *answered*. A server that answered a failed step is not inside a
collective, so the round is closed there (``/finish_weight_update`` without a version, which keeps the old
label) and the server resumed. A server that did not answer may be stuck inside the broadcast; no call is waited
on there, and the error says it stays paused until restarted.

    control = RoundControl(client, loop.run, timeout_s=600)
    control.pause()
    try:
        control.start()
        ...  # /update_weights while broadcasting
    except ServerError:
        control.abandon()
        raise
    control.finish("step-3")
    control.resume()
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from asyncgrpo.errors import ServerError, WeightTransferError
from asyncgrpo.weights.base import ServerControl

logger = logging.getLogger(__name__)

ABANDON_CALL_TIMEOUT_S = 30.0  # each closing call of a failed round (the server answered, so it is not stuck)
RESUME_RETRIES = 3  # a resume is idempotent: worth repeating after a dropped connection

RunFn = Callable[[Coroutine[Any, Any, Any], float, str], Any]  # LoopThread.run: (coroutine, timeout, what) -> result


async def finish_and_reset(client: ServerControl, version: str, timeout_s: float) -> None:
    """``/finish_weight_update`` (labelling ``version``) and ``/reset_prefix_cache`` side by side."""
    await asyncio.gather(client.finish_weight_update(version, timeout=timeout_s), client.reset_prefix_cache())


class RoundControl:
    """Pause, start, finish and resume one server for a weight round; :meth:`abandon` ends a failed one.

    Args:
        client: the server's client, bound to the loop ``run`` drives.
        run: runs a coroutine on that loop with a timeout and a description (``LoopThread.run``).
        timeout_s: bound on each step.
    """

    def __init__(self, client: ServerControl, run: RunFn, timeout_s: float) -> None:
        self.client, self._run, self.timeout_s = client, run, timeout_s

    def pause(self) -> None:
        """``/pause?mode=keep&clear_cache=true``: running requests freeze, and their KV is recomputed on resume."""
        coro = self.client.pause("keep", timeout=self.timeout_s, clear_cache=True)
        self._run(coro, self.timeout_s, "POST /pause?mode=keep")

    def start(self) -> None:
        self._run(self.client.start_weight_update(timeout=self.timeout_s), self.timeout_s, "POST /start_weight_update")

    def finish(self, version: str) -> None:
        """``/finish_weight_update`` (labelling ``version``) and ``/reset_prefix_cache`` together: both only need
        the weights loaded and must precede ``/resume``, so the round waits one round trip instead of two."""

        coro = finish_and_reset(self.client, version, self.timeout_s)
        self._run(coro, self.timeout_s, "POST /finish_weight_update and /reset_prefix_cache")

    def resume(self) -> None:
        self._run(self.client.resume(timeout=self.timeout_s), self.timeout_s, "POST /resume")

    def abandon(self) -> bool:
        """End a failed round on a server that answered: close its update, then resume it.

        vLLM clears its active flag when an update fails, so the finish is a 500 then; the update is closed with a
        start/finish pair instead (see the comment below). Returns whether the server was resumed; the caller
        raises the round's error either way.
        """
        url, limit = self.client.base_url, ABANDON_CALL_TIMEOUT_S
        # Both calls are retried on a dropped connection: vLLM's server closes the connection after a 500 that an
        # unhandled worker error produced, and the next call on the pooled connection is reset.
        if not self._close():
            # vLLM ended the update when it failed, but its start had moved the model's weights to the meta device
            # (layerwise reload); only a finish puts them back, and a forward before that kills the engine
            # (EngineDeadError). A start/finish pair with nothing loaded restores the weights held since the start.
            logger.info("closing the failed weight update on %s with a start/finish pair", url)
            try:
                self._run(self.client.request("POST", "/start_weight_update", timeout=limit, retries=2),
                          3 * limit + 5, "POST /start_weight_update")  # fmt: skip
            except (ServerError, WeightTransferError) as exc:
                logger.warning("could not reopen the failed weight update on %s: %s", url, exc)
            self._close()
        try:
            resume = self.client.request("POST", "/resume", timeout=limit, retries=RESUME_RETRIES)
            self._run(resume, (RESUME_RETRIES + 1) * limit + 5, "POST /resume")
        except (ServerError, WeightTransferError) as exc:
            logger.error("could not resume %s after a failed weight round: %s. It stays paused (every request "
                         "queues): POST %s/resume, or restart it", url, exc, url)  # fmt: skip
            return False
        logger.warning("weight round on %s failed; the round was closed and the server resumed", url)
        return True

    def _close(self) -> bool:
        """``/finish_weight_update`` without a version (the old label stays); False when the server refused it."""
        limit = ABANDON_CALL_TIMEOUT_S
        finish = self.client.request("POST", "/finish_weight_update", json_body={}, timeout=limit, retries=2)
        try:
            self._run(finish, 3 * limit + 5, "POST /finish_weight_update")
        except (ServerError, WeightTransferError) as exc:
            logger.info("finishing the failed weight update on %s: %s", self.client.base_url, exc)
            return False
        return True

    def left_paused_message(self) -> str:
        """What to tell the user when the server may be inside the collective (no call waited on it)."""
        return (
            f"the server {self.client.base_url} did not answer POST /update_weights and may be waiting inside the "
            "weight broadcast: it stays paused. Restart it (or POST /resume once it answers again)"
        )

"""The weight receiver of an engine in its own process, as the API process sees it.

The receiver must sit beside the weights, so with ``process.py``'s engine it runs in the engine process; this
stand-in forwards each protocol step over the engine's pipe and offers the same members as the receiver itself
(:class:`~asyncgrpo.server.engine.api.ReceiverAPI`), so the HTTP routes cannot tell the two apart.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Protocol

from asyncgrpo.server.engine.awaiting import awaited


class EngineCaller(Protocol):
    """How to reach the engine process (``process.RemoteEngine``; named here, not imported: it imports this)."""

    def call(self, target: str, name: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any: ...
    def call_future(self, target: str, name: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future: ...


class RemoteReceiver:
    """The weight receiver's protocol steps, run beside the weights in the engine process."""

    def __init__(self, engine: EngineCaller) -> None:
        self.engine = engine

    def init(self, info: Any) -> None:
        self.engine.call("receiver", "init", info)

    def start(self) -> None:
        self.engine.call("receiver", "start", timeout=60)

    def update(self, info: Any) -> None:
        self.engine.call("receiver", "update", info)

    def finish(self, version: Any) -> str:
        return self.engine.call("receiver", "finish", version, timeout=300)

    # The event-loop forms (see WeightReceiver): the loop awaits the pipe's answer instead of blocking on it.
    async def start_async(self) -> None:
        await awaited(self.engine.call_future("receiver", "start"), "the engine process to start the update", 60)

    async def update_async(self, info: Any) -> None:
        await awaited(self.engine.call_future("receiver", "update", info), "the weight update in the engine process")

    async def finish_async(self, version: Any) -> str:
        fut = self.engine.call_future("receiver", "finish", version)
        return await awaited(fut, "the engine process to finish the update", 300)

    async def round_step_async(self, info: Any, begin: bool, end: bool, version: Any) -> str:
        fut = self.engine.call_future("receiver", "round_step", info, begin, end, version)
        return await awaited(fut, "the weight round step in the engine process")

    def set_profile(self, enabled: bool) -> bool:
        return self.engine.call("receiver", "set_profile", enabled, timeout=60)

    def last_profile(self) -> dict[str, Any] | None:
        return self.engine.call("receiver", "last_profile", timeout=300)

    def shutdown(self) -> None:
        self.engine.call("receiver", "shutdown", timeout=300)

"""Where a weight round's time goes, on one end of the group: a timeline of its packs, broadcasts and unpacks.

Only when asked (``ASYNCGRPO_WEIGHT_SYNC_PROFILE=1`` in the environment of the trainer or the server, or
``WeightSender(profile=True)``): on CUDA each span is a pair of timing events recorded on the stream that does the
work, read after the round's closing synchronisation, so the normal path gains no host-device sync. Over gloo
(CPU, synchronous) the spans are wall-clock.

The summary is in milliseconds, relative to the round's first mark:

- ``span_ms``: first mark to last (this end's whole share of the round on the device);
- ``fill_ms``: until the first broadcast starts (the first pack; on the sender also the wait for the receiver);
- ``drain_ms``: from the last broadcast's end to the end (the last unpack on the receiver);
- ``wire_busy_ms``: time some broadcast ran (union of spans); ``wire_gaps_ms``: idle time between the first
  broadcast's start and the last one's end (the wire waited for a pack, an unpack or the host);
- ``broadcast_ms`` / ``pack_ms`` / ``unpack_ms``: sums of the spans of each kind (copies overlap broadcasts, so
  these add up to more than ``span_ms`` when the pipeline works), with their counts;
- ``host_enqueue_ms``: host wall time of the loop that queued the work (above ``span_ms``: host-bound).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from asyncgrpo.errors import ServerError

logger = logging.getLogger(__name__)
PROFILE_ENV = "ASYNCGRPO_WEIGHT_SYNC_PROFILE"


def profiling_requested() -> bool:
    """Whether the environment asks for weight-sync timelines (``ASYNCGRPO_WEIGHT_SYNC_PROFILE=1``)."""
    return os.environ.get(PROFILE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class WireProfile:
    """Spans of one round on one end; ``summary()`` after the round's work finished on the device."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.spans: list[tuple[str, Any, Any]] = []
        self._begin: Any = None
        self._end: Any = None
        self._host = [time.perf_counter(), 0.0]
        self.bytes = 0

    def mark(self, stream: torch.cuda.Stream | None = None) -> Any:
        """A point on ``stream`` (the current stream when None): a timing event on CUDA, else wall-clock seconds."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def begin(self) -> None:
        self._begin = self.mark()
        self._host[0] = time.perf_counter()

    def end(self) -> None:
        self._end = self.mark()
        self._host[1] = time.perf_counter()

    def add(self, kind: str, start: Any, end: Any) -> None:
        self.spans.append((kind, start, end))

    def _ms(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def summary(self) -> dict[str, float]:
        """Milliseconds per field of the module docstring (reads the events: call after the round synchronised)."""
        if self._begin is None or self._end is None:
            return {}
        if self.cuda:  # read from any thread (an HTTP pool thread): on the events' own device
            with torch.cuda.device(self.device):
                self._end.synchronize()  # already complete after the round's synchronisation: returns at once
                return self._summary()
        return self._summary()

    def _summary(self) -> dict[str, float]:
        out: dict[str, float] = {"span_ms": self._ms(self._begin, self._end), "bytes": float(self.bytes)}
        out["host_enqueue_ms"] = (self._host[1] - self._host[0]) * 1e3
        wire = []
        for kind in ("broadcast", "pack", "unpack"):
            spans = [(self._ms(self._begin, s), self._ms(self._begin, e)) for k, s, e in self.spans if k == kind]
            out[f"{kind}_ms"] = sum(e - s for s, e in spans)
            out[f"{kind}_count"] = float(len(spans))
            if kind == "broadcast":
                wire = sorted(spans)
        if wire:
            busy, cur_s, cur_e = 0.0, wire[0][0], wire[0][1]
            for s, e in wire[1:]:
                if s > cur_e:
                    busy += cur_e - cur_s
                    cur_s, cur_e = s, e
                else:
                    cur_e = max(cur_e, e)
            busy += cur_e - cur_s
            last_end = max(e for _, e in wire)
            out.update(wire_busy_ms=busy, wire_gaps_ms=(last_end - wire[0][0]) - busy, fill_ms=wire[0][0],
                       drain_ms=out["span_ms"] - last_end)  # fmt: skip
        return out


async def enable_server_profiles(client: Any) -> bool:
    """Ask the server to keep round timelines (our server's ``POST /weight_sync_profile``; vLLM has none: False)."""
    try:
        await client.request("POST", "/weight_sync_profile", json_body={"enabled": True}, retries=0, timeout=30.0)
    except ServerError as exc:
        logger.info("the server keeps no weight-sync timelines (%s); profiling the sender only", exc)
        return False
    return True


async def server_profile(client: Any) -> dict[str, Any] | None:
    """The server's timeline of the last round (``GET /weight_sync_profile``), None if it has none."""
    try:
        answer = await client.request("GET", "/weight_sync_profile", retries=0, timeout=30.0)
    except ServerError as exc:
        logger.warning("could not read the server's weight-sync timeline: %s", exc)
        return None
    return answer.get("profile") if isinstance(answer, dict) else None

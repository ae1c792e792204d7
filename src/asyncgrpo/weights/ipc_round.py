"""One ``ipc`` weight round on the trainer's side: the HTTP steps around :class:`~asyncgrpo.weights.ipc.IpcExport`.

Kept apart from ``weights/ipc.py`` (the codec, the backend choice and the exports, which the server side imports
too): this is the part that talks to the server through :class:`~asyncgrpo.weights.sender.WeightSender`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Generator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

import torch

from asyncgrpo.errors import ServerError, WeightTransferError
from asyncgrpo.weights.base import ServerControl
from asyncgrpo.weights.collectives import TensorMeta
from asyncgrpo.weights.ipc import IpcExport, plan_calls
from asyncgrpo.weights.loop_thread import LoopThread
from asyncgrpo.weights.round_control import RoundControl

logger = logging.getLogger(__name__)
_T = TypeVar("_T")


class Link(Protocol):
    """The one server of an ipc round (``weights.links.ServerLink``)."""

    client: ServerControl


class WeightSender(Protocol):
    """What a round needs of ``weights.sender.WeightSender`` (named here, not imported: that module imports this
    one)."""

    timeout_s: float
    packed: bool
    last_breakdown: dict[str, Any]
    pushed: dict[str, str]
    _ipc: IpcExport | None
    _loop: LoopThread | None

    def _http(self, coro: Coroutine[Any, Any, _T], what: str) -> _T: ...


def ipc_round(
    sender: WeightSender,
    link: Link,
    tensors: Iterable[torch.Tensor],
    metas: list[TensorMeta],
    *,
    version: str,
    barrier: Callable[[], None] | None,
) -> dict[str, float]:
    """One ipc round of :meth:`WeightSender.update`: pause, start, one call per body, finish, resume.

    Without a ``barrier`` the first body (the first packed chunk, or every export when unpacked) is made before
    the pause: the bytes are the trainer's own, so the server keeps generating while they are copied, and a whole
    model in one buffer leaves only the server's copy inside the pause. With a barrier (FSDP: the other ranks join
    the gathers after it) the order stays pause, barrier, start, bodies. Our server takes ``start`` together with
    the pause (one round trip); a server of another kind (a real vLLM) gets them one after the other. Every call
    is answered after the server copied its tensors; a call that fails ends the round on the server (finish,
    resume) and the sender stays usable (no group to rebuild).
    """
    export, client = sender._ipc, link.client
    assert export is not None
    if export.ours is None:
        export.ours, export.round_step = _server_kind(sender, client)
    if barrier is None and export.round_step:
        return one_request_per_call(sender, link, tensors, metas, version=version)
    t_pre = time.perf_counter()
    bodies = export.bodies(tensors, metas, packed=sender.packed)
    first: dict[str, Any] | None = None
    if barrier is None:
        try:
            first = next(bodies, None)
        except BaseException:
            export.end_round()
            raise
    t0 = time.perf_counter()
    steps: dict[str, Any] = {"prepared_before_pause_ms": (t0 - t_pre) * 1e3}

    def step(name: str) -> None:
        steps[name] = (time.perf_counter() - t0) * 1e3

    try:
        if barrier is None and export.ours:
            sender._http(_pause_and_start(sender, client), "POST /pause?mode=keep and /start_weight_update")
            t1 = t2 = time.perf_counter()
            step("pause")
        else:
            sender._http(client.pause("keep", timeout=sender.timeout_s), "POST /pause?mode=keep")
            t1 = time.perf_counter()
            step("pause")
            if barrier is not None:
                barrier()
                step("barrier")
            sender._http(client.start_weight_update(timeout=sender.timeout_s), "POST /start_weight_update")
            t2 = time.perf_counter()
    except (ServerError, WeightTransferError):
        bodies.close()
        export.end_round()
        _end_failed_round(sender, client)  # a start that went through is finished; the pause is lifted
        raise
    step("start")
    calls, posting = 0, 0.0  # the time in update calls (the server's side), the rest of "updates" is this side's
    with _updates_of_round(sender, client, bodies, export):
        body = first if barrier is None else next(bodies, None)
        while body is not None:
            t = time.perf_counter()
            sender._http(client.update_weights(body, timeout=sender.timeout_s), "POST /update_weights")
            posting += time.perf_counter() - t
            calls += 1
            body = next(bodies, None)
        step("updates")
        steps["update_calls_ms"] = posting * 1e3
        assert sender._loop is not None
        RoundControl(client, sender._loop.run, sender.timeout_s).finish(version)
    sender.pushed[client.base_url] = str(version)
    step("finish_and_reset")
    sender._http(client.resume(timeout=sender.timeout_s), "POST /resume")
    t3 = time.perf_counter()
    step("resume")
    steps["update_calls"] = calls
    sender.last_breakdown = steps
    return {"pause_s": t1 - t0, "barrier_s": t2 - t1, "transfer_s": t3 - t2, "total_s": t3 - t0}


async def _pause_and_start(sender: WeightSender, client: ServerControl) -> None:
    """``/pause?mode=keep`` and ``/start_weight_update`` side by side (our server: start only opens the round)."""
    await asyncio.gather(
        client.pause("keep", timeout=sender.timeout_s),
        client.start_weight_update(timeout=sender.timeout_s),
    )


def _server_kind(sender: WeightSender, client: ServerControl) -> tuple[bool, bool]:
    """Whether the server is the embedded one (its ``/server_info`` has an ``asyncgrpo`` section), and whether it
    takes ``/weight_round_step``; asked once per sender."""
    try:
        info = sender._http(client.server_info(), "GET /server_info")
    except (ServerError, WeightTransferError):
        return False, False
    ours = info.get("asyncgrpo") if isinstance(info, dict) else None
    if not isinstance(ours, dict):
        return False, False
    return True, ours.get("weight_round_step") is True


@contextmanager
def _updates_of_round(
    sender: WeightSender, client: ServerControl, bodies: Generator[Any, None, None], export: IpcExport
) -> Iterator[None]:
    """Around a round's update calls: a failed call ends the round on the server (``_end_failed_round``) and is
    raised as the sender's error; the bodies and the round's exports are released either way."""
    try:
        yield
    except (ServerError, WeightTransferError) as exc:
        _end_failed_round(sender, client)
        raise WeightTransferError(f"the ipc weight update of {client.base_url} failed: {exc}") from exc
    finally:
        bodies.close()
        export.end_round()


def _end_failed_round(sender: WeightSender, client: ServerControl) -> None:
    """Close the server's half-done round and resume it, by the same rule as every backend (``RoundControl``:
    vLLM clears its round on a failed update and leaves the weights on the meta device until a finish)."""
    assert sender._loop is not None
    RoundControl(client, sender._loop.run, sender.timeout_s).abandon()


def one_request_per_call(
    sender: WeightSender, link: Link, tensors: Iterable[torch.Tensor], metas: list[TensorMeta], *, version: str
) -> dict[str, float]:
    """An ipc round on the embedded server in one request per update call (``POST /weight_round_step``): the
    first carries the pause and the start, the last the finish and the resume, so a model in one buffer is one
    request instead of five (server/engine/round_step.py). The first body is made before the request, as in
    :func:`ipc_round`; the next one only after the server answered (the buffer is reused). A failed step was
    closed and the server resumed before it answered; the sender's rule for a failed round runs all the same."""
    export, client = sender._ipc, link.client
    assert export is not None
    calls = len(plan_calls(metas, sender.packed, export.buffer_size_bytes))
    t_pre = time.perf_counter()
    bodies = export.bodies(tensors, metas, packed=sender.packed)
    steps: dict[str, Any] = {}
    with _updates_of_round(sender, client, bodies, export):
        body = next(bodies, None)
        t0 = time.perf_counter()
        steps["prepared_before_pause_ms"] = (t0 - t_pre) * 1e3
        for call in range(1, max(calls, 1) + 1):
            last = call >= calls
            step_call = client.weight_round_step(body, begin=call == 1, end=last, timeout=sender.timeout_s,
                                                 weight_version=str(version) if last else None)  # fmt: skip
            sender._http(step_call, "POST /weight_round_step")
            if call == 1:
                steps["pause"] = steps["start"] = (time.perf_counter() - t0) * 1e3
            body = None if last else next(bodies, None)
    t3 = time.perf_counter()
    sender.pushed[client.base_url] = str(version)
    steps["updates"] = steps["finish_and_reset"] = steps["resume"] = (t3 - t0) * 1e3
    steps["update_calls"] = steps["round_step_requests"] = max(calls, 1)
    sender.last_breakdown = steps
    return {"pause_s": 0.0, "barrier_s": 0.0, "transfer_s": t3 - t0, "total_s": t3 - t0}

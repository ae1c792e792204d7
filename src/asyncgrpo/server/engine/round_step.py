"""Ours, not vLLM's: one request per weight-update call, carrying the steps vLLM's round sends around it (B4-IPC).

A trainer on the server's GPU (the ``ipc`` backend) copies a whole model in about 3 ms, yet each request of
vLLM's round (pause, start, update, finish, resume) crosses the API process and the engine process: about 1.5 ms
apiece on an H200 host, more than half of the round (``bench/results/ipc_sync_h200.json``). ``POST
/weight_round_step`` carries an ``update_info`` together with ``begin`` (pause with ``mode=keep`` and the caches
cleared, then start) and ``end`` (finish with the version, then resume): a round of one call is one request. The
engine process runs the steps in vLLM's order with each one's own rules (``WeightReceiver``), and a step that fails
closes the round and resumes the engine before answering, as the client's ``RoundControl.abandon`` would after
separate requests. Only the embedded server offers it (``/server_info`` ``asyncgrpo.weight_round_step``); a real
vLLM gets the five requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from asyncgrpo.server.engine.request import PauseMode
from asyncgrpo.server.errors import ApiError

logger = logging.getLogger(__name__)
T = TypeVar("T")

PAUSE_TIMEOUT_S = 60.0  # a keep pause waits for the running step to end, never for requests to finish


class PausableEngine(Protocol):
    @property
    def weight_version(self) -> str: ...
    def pause(self, mode: PauseMode, timeout: float | None = None, *, clear_cache: bool = True) -> None: ...
    def resume(self) -> None: ...
    def preempt_for_new_weights(self) -> None: ...
    def run_between_steps(self, fn: Callable[[], T], timeout: float | None = None) -> T: ...


class RoundSteps(Protocol):
    """The receiver's protocol steps (``weight_receiver.WeightReceiver``; named here, it imports this module)."""

    active: bool
    timeout_s: float  # the bound on one round's transfer (--weight-transfer-timeout)

    def start(self) -> None: ...
    def update(self, info: Any) -> None: ...
    def finish(self, version: Any) -> str: ...


def check_flags(begin: Any, end: Any) -> None:
    for name, value in (("begin", begin), ("end", end)):
        if not isinstance(value, bool):
            raise ApiError(400, f"weight_round_step: {name} must be true or false, got {value!r}", param=name)


def round_step(receiver: RoundSteps, engine: PausableEngine, info: Any, *, begin: bool, end: bool, version: Any) -> str:
    """``begin``: pause (keep, caches cleared: frozen requests recompute their KV with the new weights) and start;
    then the update when ``info`` is given; ``end``: finish (labelling the weights ``version``) and resume.
    Returns the engine's weight version after the step."""
    check_flags(begin, end)
    if begin and end:
        # bounded as the receiver bounds one update (WeightReceiver.update), plus the wait for the running step
        job = lambda: _whole_round(receiver, engine, info, version)
        return engine.run_between_steps(job, timeout=receiver.timeout_s + 30 + PAUSE_TIMEOUT_S)
    try:
        if begin:
            engine.pause("keep", PAUSE_TIMEOUT_S, clear_cache=True)
            receiver.start()
        if info is not None:
            receiver.update(info)
        if end:
            done = receiver.finish(version)
            engine.resume()
            return done
        return str(engine.weight_version)
    except BaseException:
        _close_and_resume(receiver, engine)
        raise


def _whole_round(receiver: RoundSteps, engine: PausableEngine, info: Any, version: Any) -> str:
    """A round of one call as one job on the engine thread, between two steps: no step runs while it does, so
    the pause and the resume are implied, and the frozen requests are preempted as a ``keep`` pause with cleared
    caches does. Each thread hand-off of the separate steps costs up to a GIL switch interval on a busy host; here
    there are none (the receiver's own between-steps calls run inline on this thread)."""
    engine.preempt_for_new_weights()
    receiver.start()
    try:
        if info is not None:
            receiver.update(info)
        return receiver.finish(version)
    except BaseException:
        _close(receiver)
        raise


def _close(receiver: RoundSteps) -> None:
    """After a failed step: close a round still open (vLLM mode already closed it)."""
    if receiver.active:
        try:
            receiver.finish(None)
        except ApiError as exc:  # pragma: no cover - finish of an active round only fails if unconfigured
            logger.warning("could not close the failed weight round: %s", exc.message)


def _close_and_resume(receiver: RoundSteps, engine: PausableEngine) -> None:
    """After a failed step of a round of several calls: close it and resume the engine paused by its first call."""
    _close(receiver)
    try:
        engine.resume()
    except Exception:  # the step's own error is the one to report
        logger.exception("could not resume the engine after a failed weight round step")

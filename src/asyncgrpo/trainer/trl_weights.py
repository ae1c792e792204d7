"""TRL 1.16's ``weight_transfer=`` plug-in, and ``weight_sync_timeout`` named in every weight-sync timeout.

A TRL 1.16 ``WeightTransferProtocol`` object (``init_weight_transfer``, ``pause``, ``send_weights``, ``resume``,
``destroy``) becomes this trainer's ``WeightSync`` (``weights/base.py``) through :class:`TRLWeightTransferSync`:
``init_weight_transfer`` once before the first push, then per push ``pause`` -> ``send_weights(iterator of
(name, tensor))`` -> ``resume``, and ``destroy`` when the run ends, as TRL calls them. Every call runs on a helper
thread under one deadline per round, ``weight_sync_timeout`` seconds: a transfer that stalls raises
:class:`WeightSyncTimeoutError` naming the call instead of hanging the run (the stalled thread is left behind,
as nothing can interrupt it). :class:`NamedTimeouts` gives our own senders' timeouts the same name.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from asyncgrpo.errors import WeightSyncTimeoutError, WeightTransferError
from asyncgrpo.weights.base import WeightSync
from asyncgrpo.weights.policy import policy_weights

logger = logging.getLogger(__name__)

WEIGHT_TRANSFER_METHODS = ("init_weight_transfer", "pause", "send_weights", "resume", "destroy")
DESTROY_TIMEOUT_S = 30.0  # destroy() at the end of a run: a hung one is logged, not waited for


def missing_methods(obj: Any, methods: tuple[str, ...]) -> list[str]:
    return [m for m in methods if not callable(getattr(obj, m, None))]


def check_weight_transfer_protocol(obj: Any) -> None:
    """Raise ``TypeError`` naming the first ``WeightTransferProtocol`` method ``obj`` lacks."""
    missing = missing_methods(obj, WEIGHT_TRANSFER_METHODS)
    if missing:
        raise TypeError(
            f"weight_transfer={type(obj).__name__} has no method {missing[0]}() (TRL 1.16's WeightTransferProtocol "
            f"needs {', '.join(WEIGHT_TRANSFER_METHODS)}; missing: {', '.join(missing)})"
        )


def call_within(fn: Callable[[], Any], timeout: float, what: str, limit: float | None = None) -> Any:
    """``fn()`` on a daemon thread; its result, its exception, or :class:`WeightSyncTimeoutError` after ``timeout``
    seconds (what is left of the round's ``limit``, the ``weight_sync_timeout`` the error names)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"asyncgrpo-{what}", daemon=True)
    thread.start()
    thread.join(max(timeout, 0.0))
    if thread.is_alive():
        raise WeightSyncTimeoutError(
            f"weight transfer stalled: {what} did not return within weight_sync_timeout="
            f"{timeout if limit is None else limit:g}s; raise weight_sync_timeout if a transfer of this model "
            "legitimately takes longer"
        )
    if "error" in box:
        raise box["error"]
    return box.get("value")


class TRLWeightTransferSync:
    """``WeightSync`` of rank 0 around a TRL 1.16 ``WeightTransferProtocol`` object (see the module docstring).

    Args:
        transfer: the user's object.
        timeout_s: ``weight_sync_timeout``: one round (pause, send, resume) must finish within it; so must init.
        barrier: with several trainer processes, the point where the others wait (they gather with rank 0).
    """

    backend: str | None = "custom"
    served_model: str | None = None

    def __init__(self, transfer: Any, timeout_s: float, barrier: Callable[[], None] | None = None) -> None:
        check_weight_transfer_protocol(transfer)
        self.transfer, self.timeout_s, self.barrier = transfer, timeout_s, barrier
        self._ready = False

    def push(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        if not self._ready:
            call_within(self.transfer.init_weight_transfer, self.timeout_s, "init_weight_transfer()")
            self._ready = True
        deadline = time.monotonic() + self.timeout_s
        left = lambda: deadline - time.monotonic()  # one deadline for the whole round
        call_within(self.transfer.pause, left(), "pause()", self.timeout_s)
        t_pause = time.perf_counter()
        if self.barrier is not None:
            self.barrier()
        t_barrier = time.perf_counter()
        call_within(lambda: self.transfer.send_weights(policy_weights(model)), left(), "send_weights()",
                    self.timeout_s)  # fmt: skip
        t_sent = time.perf_counter()
        call_within(self.transfer.resume, left(), "resume()", self.timeout_s)
        t_end = time.perf_counter()
        return {"perf/weight_sync_s": t_end - t0, "perf/weight_sync_pause_s": t_pause - t0,
                "perf/weight_sync_barrier_s": t_barrier - t_pause,
                "perf/weight_sync_transfer_s": t_sent - t_barrier}  # fmt: skip

    def close(self) -> None:
        try:
            call_within(self.transfer.destroy, min(self.timeout_s, DESTROY_TIMEOUT_S), "destroy()")
        except WeightSyncTimeoutError as exc:
            logger.warning("%s", exc)


class NamedTimeouts:
    """Our own ``WeightSync`` (its waits bounded by ``weight_sync_timeout``), with that name in its timeout errors."""

    def __init__(self, inner: WeightSync, timeout_s: float) -> None:
        self.inner, self.timeout_s = inner, timeout_s

    @property
    def backend(self) -> str | None:
        return self.inner.backend

    @property
    def served_model(self) -> str | None:
        return self.inner.served_model

    def push(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        try:
            return self.inner.push(model, step)
        except (WeightTransferError, TimeoutError) as exc:
            if isinstance(exc, WeightSyncTimeoutError) or not _is_timeout(exc):
                raise
            raise WeightSyncTimeoutError(f"weight sync of step {step} ran past weight_sync_timeout="
                                         f"{self.timeout_s:g}s: {exc}") from exc  # fmt: skip

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # the sender's own attributes (links, restarts, ...) for diagnostics
        return getattr(self.inner, name)


def _is_timeout(exc: BaseException) -> bool:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc).lower()  # ours: "timed out after", "no answer within"; gloo's: "Timed out waiting"
        if isinstance(exc, TimeoutError) or any(
            w in text for w in ("timed out", "no answer within", "not finish within")
        ):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False

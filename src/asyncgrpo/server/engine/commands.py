"""The messages an engine is driven by: one small frozen record per command, dispatched by type.

Two channels carry them. Other threads post *loop commands* to the engine thread (``loop.py``), each with a
future for its answer. The API process and the engine process (``process.py``) exchange *pipe messages*, pickled
over one duplex pipe, so those hold only picklable values (requests, outputs, call arguments, error fields).
A record per command, not a tagged tuple, so a misspelt kind or a missing field fails where the message is
built, and a reader sees in one place what each command carries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asyncgrpo.server.engine.request import PauseMode, Request, RequestOutput

if TYPE_CHECKING:
    from asyncgrpo.server.engine.scheduler import Sequence


# ---------------------------------------------------------------------- to the engine thread
@dataclass(frozen=True, slots=True)
class AddSequence:
    """Queue a new request (already validated). It waits apart from the other commands: see ``loop.py``."""

    seq: Sequence


@dataclass(frozen=True, slots=True)
class Abort:
    """Finish a request with finish_reason "abort" (keeping its tokens); an unknown id is ignored.
    Also a pipe message: the API process forwards a client's abort."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Pause:
    """Pause per ``mode``; the future is answered once the pause is in effect (``wait``: once drained)."""

    mode: PauseMode
    clear_cache: bool = True


@dataclass(frozen=True, slots=True)
class Resume:
    """Leave any pause."""


@dataclass(frozen=True, slots=True)
class RunCall:
    """Run ``fn`` on the engine thread between two steps; the future holds its result or error."""

    fn: Callable[[], Any]


@dataclass(frozen=True, slots=True)
class Stop:
    """Abort what is in flight and end the engine thread. Also a pipe message: stop the engine process."""


LoopCommand = AddSequence | Abort | Pause | Resume | RunCall | Stop


# ---------------------------------------------------------------------- API process -> engine process
@dataclass(frozen=True, slots=True)
class Submit:
    """A request for the engine process (validated by the API process, which keeps it)."""

    request: Request


@dataclass(frozen=True, slots=True)
class RemoteCall:
    """Call ``target.name(*args, **kwargs)`` in the engine process (or read the attribute); ``target`` is
    ``"engine"`` or ``"receiver"``. Answered by a :class:`Reply` with the same ``call_id``."""

    call_id: int
    target: str
    name: str
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


ToEngine = Submit | Abort | RemoteCall | Stop


# ---------------------------------------------------------------------- engine process -> API process
@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An exception as fields that pickle anywhere: an ``ApiError``'s status and body, or a type name and text."""

    type_name: str
    message: str
    status: int | None = None  # set for an ApiError
    param: str | None = None
    api_type: str | None = None


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine is built; ``info`` holds what the API process reports without asking (sizes, device)."""

    info: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Failed:
    """Building the engine failed; the engine process exits after sending this."""

    error: ErrorInfo


@dataclass(frozen=True, slots=True)
class Finished:
    """A request finished (its ``prompt_token_ids`` left out: the API process has them)."""

    output: RequestOutput


@dataclass(frozen=True, slots=True)
class Reply:
    """The answer to a :class:`RemoteCall`: its value, or the error it raised."""

    call_id: int
    value: Any = None
    error: ErrorInfo | None = None


FromEngine = Ready | Failed | Finished | Reply

"""The project's error classes: the generation-server client's, the weight transfer's, and ``UserError``.

One neutral module (no project imports) so ``client/``, ``weights/``, ``server/`` and the commands raise and catch
the same classes without importing each other.

Every error names what was waited for or called, so a failed run says which
endpoint or collective to look at (SPEC X4). ``UserError`` is a mistake in what the user gave (a config, a
dataset, a run folder): the command prints its message alone and exits with code 2.
"""

from __future__ import annotations


class ServerError(RuntimeError):
    """A generation-server call failed: an HTTP error status, or no usable answer.

    Attributes:
        endpoint: ``"METHOD /path"`` of the call.
        status: the HTTP status, or None when no answer came (connection refused, timeout).
        message: the server's error message (``error.message`` of vLLM's error body) or the cause.
    """

    def __init__(
        self, endpoint: str, status: int | None, message: str, *, base_url: str = "", refused: bool = False
    ) -> None:
        self.endpoint = endpoint
        self.refused = refused  # no connection could be made (nothing listens at the address)
        self.status = status
        self.message = message
        self.base_url = base_url
        where = f" at {base_url}" if base_url else ""
        code = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{endpoint}{where} failed ({code}): {message}")

    @property
    def retryable(self) -> bool:
        """True for errors worth retrying: no answer, or 503 (paused / overloaded)."""
        return self.status is None or self.status == 503


class ServerTimeoutError(ServerError, TimeoutError):
    """A call or a wait on the server ran past its timeout."""


class WeightTransferError(RuntimeError):
    """The weight-transfer handshake or a broadcast failed or timed out.

    After this error the collective group is in an unknown state: the run should
    stop (the server may be stuck inside a collective and need a restart).
    """


class WeightSyncTimeoutError(WeightTransferError, TimeoutError):
    """A weight sync ran past ``weight_sync_timeout`` (the message names it and the call that stalled)."""


class UserError(ValueError):
    """A mistake in the user's input: the command prints the message alone and exits with code 2."""

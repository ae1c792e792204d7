"""The errors of the embedded server, shared by the engine and the HTTP layer.

An :class:`ApiError` carries the HTTP status and vLLM's error body, but is raised deep in the engine side too
(the weight receivers refuse a bad ``update_info`` with the status vLLM answers). It lives here, apart from
both layers, so the engine never imports the HTTP layer to raise one, and an engine in its own process can
rebuild it from its fields after the pipe.
"""

from __future__ import annotations

from typing import Any

_ERROR_TYPES = {400: "BadRequestError", 403: "ForbiddenError", 404: "NotFoundError", 409: "ConflictError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}  # fmt: skip


class ApiError(Exception):
    """An error answered with vLLM's body ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or _ERROR_TYPES.get(status, "Error")

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, type_=self.type)


def error_body(status: int, message: str, *, param: str | None = None, type_: str | None = None) -> dict[str, Any]:
    """vLLM's error body; the type is named after the status unless given."""
    return {"error": {"message": message, "type": type_ or _ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}  # fmt: skip

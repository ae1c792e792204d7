"""Talking to generation servers: the async HTTP client (vLLM 0.33 protocol) and the weight transfer.

``WeightSender`` (trainer side of the weight sync) imports torch, so it is loaded on first use.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.inference.client import AsyncServerClient
from asyncgrpo.inference.errors import ServerError, ServerTimeoutError, WeightTransferError
from asyncgrpo.inference.results import GenerationResult, VersionSpan

__all__ = [
    "AsyncServerClient",
    "GenerationResult",
    "ServerError",
    "ServerTimeoutError",
    "VersionSpan",
    "WeightSender",
    "WeightTransferError",
]


def __getattr__(name: str) -> Any:
    if name == "WeightSender":
        from asyncgrpo.inference.weight_transfer import WeightSender

        return WeightSender
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

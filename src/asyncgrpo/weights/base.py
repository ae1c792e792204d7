"""The two seams of the weight sync: what it needs of a server, and what the trainer needs of it.

``weights/`` never imports the HTTP client (``asyncgrpo.client``) nor the rollout worker: the calls a sender
makes are declared here as :class:`ServerControl`, which ``client/http_client.AsyncServerClient`` satisfies
(``tests/unit/test_weight_seams.py`` checks every member against it), and the trainer's wiring hands the
senders clients. The trainer holds one :class:`WeightSync`, whatever carries the weights (merged weights over
NCCL/gloo/CUDA IPC to one or several servers, or LoRA adapters through the server's adapter routes), so it has
no branch per mode.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, Self, runtime_checkable

import torch


class ServerControl(Protocol):
    """The generation-server calls the weight sync makes (docs/protocol.md): one server's HTTP client."""

    base_url: str

    def clone(self) -> Self:
        """A client of the same server for another event loop (a sender runs its own)."""
        ...

    async def close(self) -> None: ...

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: Mapping[str, str] | None = None,
        timeout: float | None = None,
        retries: int | None = None,
        parse: str = "json",
    ) -> Any: ...

    async def health(self) -> bool: ...

    async def wait_until_ready(
        self, timeout: float, poll_s: float = 0.5, log_every: float = 30.0, refused_timeout: float | None = None
    ) -> None: ...

    async def version(self) -> str: ...

    async def server_info(self) -> dict[str, Any]: ...

    async def world_size(self) -> int: ...

    async def pause(self, mode: str = "abort", timeout: float | None = None, *, clear_cache: bool | None = None
                    ) -> None: ...  # fmt: skip

    async def resume(self, timeout: float | None = None) -> None: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def init_weight_transfer_engine(self, init_info: Mapping[str, Any], timeout: float | None = None
                                          ) -> None: ...  # fmt: skip

    async def start_weight_update(self, timeout: float | None = None) -> None: ...

    async def update_weights(self, update_info: Mapping[str, Any], timeout: float | None = None) -> Any: ...

    async def finish_weight_update(self, weight_version: str | None = None, timeout: float | None = None
                                   ) -> None: ...  # fmt: skip

    async def weight_round_step(self, update_info: Mapping[str, Any] | None, *, begin: bool, end: bool,
                                weight_version: str | None = None, timeout: float | None = None) -> Any: ...  # fmt: skip

    async def shutdown_weight_transfer_engine(self, timeout: float | None = None) -> None: ...

    async def load_lora_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> None: ...

    async def unload_lora_adapter(self, name: str) -> None: ...


@runtime_checkable
class WeightSync(Protocol):
    """How the trainer publishes its policy to the generation servers, on every process.

    ``push`` is collective: every trainer process calls it at the same point (sharded tensors are gathered
    together); the process that talks to the servers returns the round's ``perf/weight_sync_*`` metrics, the
    others an empty dict.

    Attributes:
        backend: what carries the weights (``nccl``, ``gloo``, ``ipc``; ``adapter`` for LoRA files), for messages
            such as the shared-GPU out-of-memory hint.
        served_model: the model name requests must use to get the newest policy (an adapter's name), or None when
            the server's own model name serves it.
    """

    backend: str | None
    served_model: str | None

    def push(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """Publish ``model``'s policy as version ``step``; returns the metrics to log."""
        ...

    def close(self) -> None:
        """Leave the servers (the transfer groups, the clients); the object is not used again."""
        ...

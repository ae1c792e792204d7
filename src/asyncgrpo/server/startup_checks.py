"""Checks ``asyncgrpo serve`` makes before loading a model: where the model is, and whether the port is free.

A model is a local directory or a hub id, as with ``vllm serve``: a hub id resolves through the Hugging Face
cache (downloaded when the hub is reachable; with ``HF_HUB_OFFLINE=1`` only the cache is read). The port is
bound once and released, so a busy port is reported in a line instead of after minutes of loading.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path


class StartupError(ValueError):
    """The server cannot start with these arguments; the message says what to change."""


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def resolve_model_dir(model: str) -> str:
    """A local checkpoint directory for ``model`` (a directory, or a hub id found in or fetched into the HF cache).

    Raises:
        StartupError: no such directory, an invalid hub id, a hub id not cached while offline, or a failed download.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if model.startswith((".", "/", "~")) or path.exists() or model.count("/") > 1:
        raise StartupError(f"model directory {model} does not exist (pass a checkpoint directory or a hub id)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return snapshot_download(model, local_files_only=_offline())
    except HFValidationError as e:
        raise StartupError(f"{model!r} is neither a local directory nor a valid hub id: {e}") from e
    except LocalEntryNotFoundError as e:
        how = "HF_HUB_OFFLINE is set" if _offline() else "the hub could not be reached"
        raise StartupError(
            f"model {model} is not in the Hugging Face cache ({HF_HUB_CACHE}) and {how}: download it on a machine "
            f"with network (`hf download {model}`) and copy the cache, or pass a local directory"
        ) from e
    except RepositoryNotFoundError as e:
        raise StartupError(f"no model {model} on the hub (or it is gated/private: log in with `hf auth login`)") from e
    except OSError as e:
        raise StartupError(f"cannot fetch {model} from the hub: {e}") from e


def check_port(host: str, port: int) -> None:
    """Bind ``host:port`` once and release it; StartupError naming the fix when it is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp binds: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as e:
            raise StartupError(
                f"cannot listen on {host}:{port} ({e.strerror or e}): another server uses the port; pass "
                f"--port with a free one or stop the other process"
            ) from e

"""The run's generation server, for ``asyncgrpo train``, ``demo`` and ``eval``: an external one waited for, or the
embedded ``asyncgrpo serve`` launched beside the trainer (its flags, environment and CPU threads, its start-up
errors as user errors)."""

from __future__ import annotations

import contextlib
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from asyncgrpo.errors import UserError
from asyncgrpo.trainer.gpu_share import EMBEDDED_GPU_SHARE, SHARE_FLAG

if TYPE_CHECKING:
    from asyncgrpo.server.launcher import ServerProcess

logger = logging.getLogger(__name__)


def wait_for_server(base_url: str, wait_s: float) -> None:
    """Poll ``/health`` of an external server; a clear error (not a silent 30-minute wait) when none answers."""
    logger.info("waiting up to %.0f s for the generation server at %s", wait_s, base_url)
    t0 = time.monotonic()
    deadline, next_note = t0 + wait_s, t0 + 30
    while True:
        if time.monotonic() >= next_note:
            logger.info(
                "still waiting for the generation server at %s/health (%.0f s)", base_url, time.monotonic() - t0
            )
            next_note += 30
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() >= deadline:
            raise UserError(
                f"no generation server answers at {base_url} (waited {wait_s:.0f} s for /health): start one with "
                "`asyncgrpo serve MODEL` (or vllm serve), point args.vllm_server_base_url at it, or set "
                "`server: {embedded: true}` in the YAML"
            )
        time.sleep(1.0)


def start_embedded(stack: contextlib.ExitStack, model: str, server_cfg: dict[str, Any]) -> str:
    """Start ``asyncgrpo serve`` for the run (stopped with ``stack``) and wait for it; returns its base URL."""
    return await_embedded(launch_embedded(stack, model, server_cfg)).base_url


def launch_embedded(stack: contextlib.ExitStack, model: str, server_cfg: dict[str, Any]) -> ServerProcess:
    """Start ``asyncgrpo serve`` for the run (stopped with ``stack``) without waiting for it: the caller builds the
    trainer meanwhile, then :func:`await_embedded` waits (both take tens of seconds on a GPU)."""
    from asyncgrpo.server.launcher import launch_server

    timeout = float(server_cfg.get("timeout", 600))
    flags = server_flags(server_cfg)
    if flags.count("--device") == 1 and _flag_value(flags, "--device", "") == "auto":
        import torch  # loaded here already; told the device, the server starts its engine before it imports torch

        flags[flags.index("--device") + 1] = "cuda" if torch.cuda.is_available() else "cpu"
    with _embedded_errors():
        env = {**embedded_env(flags), **split_cpu_threads(flags)}
        return stack.enter_context(launch_server(model, extra_args=flags, timeout=timeout, env=env, wait=False))


def await_embedded(server: ServerProcess) -> ServerProcess:
    """Wait for a server of :func:`launch_embedded`. One that exits during start-up (a bad flag in ``server.args``,
    a model it cannot load) or never answers is reported with its log tail as a user error, not as a traceback."""
    with _embedded_errors():
        return server.wait_ready()


@contextlib.contextmanager
def _embedded_errors() -> Iterator[None]:
    from asyncgrpo.server.launcher import PortTaken

    try:
        yield
    except PortTaken as e:  # its URL is already in the trainer's config: no moving to another port
        raise UserError(f"the embedded generation server did not start: {e}\n(another process took the free port "
                        "chosen for it a moment earlier; run again)") from e  # fmt: skip
    except RuntimeError as e:
        hint = ""
        if "out of memory" in str(e).lower() or "KV-cache tokens fit" in str(e):
            hint = (f"\n(the server's share of the GPU is its {SHARE_FLAG}, set in the YAML's server.args; on the "
                    "trainer's GPU the two must fit together: see docs/gpus.md, One GPU)")  # fmt: skip
        raise UserError(
            f"the embedded generation server did not start (check the YAML's server section): {e}{hint}"
        ) from e
    except TimeoutError as e:
        raise UserError(f"{e}\n(raise server.timeout if the machine is just slow)") from e


def server_flags(server_cfg: dict[str, Any]) -> list[str]:
    """``asyncgrpo serve`` flags of the YAML's ``server`` section (device, dtype, then its own args).

    A server on the trainer's GPU (device ``auto``, ``cuda`` or ``cuda:0``: the trainer's default) gets
    ``--gpu-memory-utilization`` 0.3 unless its args set one, so the trainer keeps most of the GPU.
    """
    device = str(server_cfg.get("device", "auto"))
    extra = ["--device", device]
    if "dtype" in server_cfg:
        extra += ["--dtype", str(server_cfg["dtype"])]
    own = [str(a) for a in server_cfg.get("args", [])]
    if device in ("auto", "cuda", "cuda:0") and not any(a.split("=")[0] == SHARE_FLAG for a in own):
        extra += [SHARE_FLAG, str(EMBEDDED_GPU_SHARE)]
    return extra + own


def _flag_value(flags: list[str], name: str, default: str) -> str:
    """The value after ``name`` in ``asyncgrpo serve`` flags (``server_flags`` writes each as two words)."""
    return next((flags[i + 1] for i, a in enumerate(flags[:-1]) if a == name), default)


def embedded_env(flags: list[str]) -> dict[str, str]:
    """The embedded server's environment: the switch vLLM's ipc backend needs to unpickle the trainer's CUDA IPC
    handles, set only while the server listens on this machine alone (a pickle is code: never off-host)."""
    from asyncgrpo.weights.ipc import INSECURE_ENV

    host = _flag_value(flags, "--host", "127.0.0.1")
    if host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("the embedded server listens on %s: %s stays unset, so weights cannot travel over ipc (CUDA "
                       "IPC) and a trainer on its GPU stops at start", host, INSECURE_ENV)  # fmt: skip
        return {}
    return {INSECURE_ENV: "1"}


def split_cpu_threads(flags: list[str], cores: int | None = None) -> dict[str, str]:
    """When the embedded server and the trainer both compute on this machine's CPU, give each half the cores.

    Left alone, each process starts one torch thread per core, and the two sets of spinning threads take turns on
    the same cores: on 2 cores the demo took 616 s so, 482 s with one thread each (``bench/LOG.md``). The server
    gets ``OMP_NUM_THREADS`` (returned, for its environment); this process sets its own torch threads. An
    ``OMP_NUM_THREADS`` the user set, a server on a GPU or a trainer with CUDA is left as it is.
    """
    import os

    import torch

    device = _flag_value(flags, "--device", "auto")
    if "OMP_NUM_THREADS" in os.environ or torch.cuda.is_available() or device.startswith("cuda"):
        return {}
    cores = cores or len(os.sched_getaffinity(0))
    server = max(1, cores // 2)
    torch.set_num_threads(max(1, cores - server))
    logger.info("server and trainer share this machine's %d CPU cores: %d torch threads for the server, %d for "
                "the trainer (set OMP_NUM_THREADS to choose)", cores, server, torch.get_num_threads())  # fmt: skip
    return {"OMP_NUM_THREADS": str(server)}

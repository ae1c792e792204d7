"""LoRA adapter sync (SPEC T6): a server started with ``--enable-lora`` gets each policy version as a PEFT adapter.

Instead of merged weights over NCCL, each sync writes the trained adapter (PEFT ``save_pretrained`` layout:
``adapter_config.json`` + ``adapter_model.safetensors``) to ``<output_dir>/.vllm_lora/<prefix>-step-<N>/`` and
registers it with ``POST /v1/load_lora_adapter``; the rollout worker then names that adapter in each request's
``model`` field (``RolloutSettings.request_model``). vLLM reads adapters from disk, so a remote server needs
``output_dir`` on a filesystem both machines see.

Staleness window: a rollout keeps the adapter of the version it started under until it ends, and the trainer
drops samples more than ``max_staleness`` versions old, so ``max_staleness + 1`` versions stay registered. Each
sync loads the new version *before* it unloads the oldest and deletes its directory, so at most
``max_staleness + 2`` adapters are live at once: the server needs ``--max-loras >= max_staleness + 2`` and
``--max-lora-rank >=`` the adapter's rank (checked at start by :func:`check_adapter_server`).

``.vllm_lora`` is a serving cache, not where the trained adapter is kept: checkpoints keep it.

:class:`AdapterPublisher` (rank 0) and :class:`AdapterFollower` (the other trainer processes) are the adapter
kind of ``weights/base.WeightSync``: the trainer pushes through them as through the merged-weight sender.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.errors import ServerError
from asyncgrpo.weights.base import ServerControl

logger = logging.getLogger(__name__)

LORA_CACHE_DIR = ".vllm_lora"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the values vLLM accepts for --max-lora-rank
RUNTIME_LORA_HINT = (
    "start vLLM with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (and --api-server-count 1), or `asyncgrpo serve --enable-lora`"
)


@dataclass(frozen=True)
class AdapterSyncSettings:
    """Where adapters go and how many stay registered.

    Args:
        base_urls: the generation servers (every one gets every adapter).
        output_dir: the run's ``output_dir``; adapters go to ``<output_dir>/.vllm_lora/``.
        max_staleness: the config's ``max_staleness``: ``max_staleness + 1`` versions stay registered.
        prefix: adapter names are ``<prefix>-step-<N>`` (the worker builds the same names).
        timeout_s: one HTTP call's limit (load/unload).
        restart_timeout_s: how long a load waits for a server that stopped answering (it may be restarting).
    """

    base_urls: tuple[str, ...]
    output_dir: str
    max_staleness: int
    prefix: str
    timeout_s: float = 300.0
    restart_timeout_s: float = 0.0


def lora_cache_dir(output_dir: str) -> str:
    """Where a run's adapter versions live (``<output_dir>/.vllm_lora``)."""
    return str(Path(output_dir) / LORA_CACHE_DIR)


def _peft_config(model: torch.nn.Module) -> Any:
    adapter = getattr(model, "active_adapter", "default")
    adapter = adapter[0] if isinstance(adapter, list) else adapter
    return model.peft_config[adapter], adapter


def adapter_rank(model: torch.nn.Module) -> int:
    """The largest LoRA rank of the model's active adapter (``r`` and any ``rank_pattern`` value)."""
    cfg, _ = _peft_config(model)
    return max([int(cfg.r), *(int(v) for v in (getattr(cfg, "rank_pattern", None) or {}).values())])


def check_adapter_server(
    rank: int, max_staleness: int, max_lora_rank: int, max_loras: int, other_adapters: list[str]
) -> None:
    """Fail at start when the server cannot hold the run's adapters; say which server flag to raise.

    Raises:
        ValueError: the adapter rank exceeds ``--max-lora-rank``, or ``--max-loras`` (less adapters someone else
            loaded) is below ``max_staleness + 2``.
    """
    problems = []
    if rank > max_lora_rank:
        fit = next((r for r in VLLM_LORA_RANKS if r >= rank), rank)
        problems.append(
            f"the LoRA adapter has rank {rank} but the server was started with --max-lora-rank {max_lora_rank}: "
            f"restart it with --max-lora-rank {fit} (or lower peft_config.r)"
        )
    need = max_staleness + 2 + len(other_adapters)
    if max_loras < need:
        others = f" plus the {len(other_adapters)} adapters already loaded ({other_adapters})" if other_adapters else ""
        problems.append(
            f"the trainer keeps max_staleness + 1 = {max_staleness + 1} adapter versions registered and loads the next "
            f"before releasing the oldest, so it needs {max_staleness + 2} adapter slots{others}; the server was "
            f"started with --max-loras {max_loras}: restart it with --max-loras {need} (or lower max_staleness)"
        )
    if problems:
        raise ValueError("adapter sync (the server runs with --enable-lora):\n  - " + "\n  - ".join(problems))


def warn_nothing_kept(save_strategy: Any) -> None:
    """``.vllm_lora`` holds only the live versions: without checkpoints the trained adapter is lost at the end."""
    if str(getattr(save_strategy, "value", save_strategy)) == "no":
        logger.warning(
            "save_strategy='no' with adapter sync: <output_dir>/%s is only a serving cache that keeps the newest "
            "adapter versions and deletes each one as it leaves the staleness window, so nothing of the trained "
            "adapter will be left when the run ends. Keep checkpoints (save_strategy='steps') or save the model "
            "yourself after train().",
            LORA_CACHE_DIR,
        )


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The active adapter's tensors under PEFT's saved names, whole and on the CPU.

    Collective under FSDP2 (a sharded tensor is gathered): every rank must call it, in step.
    """
    from peft import get_peft_model_state_dict

    _, adapter = _peft_config(model)
    out = {}
    for name, t in get_peft_model_state_dict(model, adapter_name=adapter).items():
        full = getattr(t, "full_tensor", None)
        out[name] = (full() if callable(full) else t).detach().to("cpu", copy=True).contiguous()
    return out


def write_adapter(model: torch.nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``state`` as a PEFT adapter directory (written beside ``path`` first, then renamed into place)."""
    from safetensors.torch import save_file

    cfg, _ = _peft_config(model)
    staging = path.with_name(path.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    cfg.save_pretrained(str(staging))
    save_file(state, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(path, ignore_errors=True)
    staging.rename(path)


class AdapterPublisher:
    """Rank 0's side of adapter sync: write, register and retire adapter versions (see the module docstring).

    Args:
        settings: where adapters go and how many stay registered.
        connect: a new client of a server URL without retries, bounded by ``settings.timeout_s`` per call (the
            wiring passes ``AsyncServerClient``'s); each call opens and closes its own.
        adapter_name: ``(prefix, version) -> name``, the rollout worker's naming rule (``lora_adapter_name``).
    """

    backend = "adapter"

    def __init__(self, settings: AdapterSyncSettings, connect: Callable[[str], ServerControl],
                 adapter_name: Callable[[str, int], str]) -> None:  # fmt: skip
        self.settings, self.connect, self.adapter_name = settings, connect, adapter_name
        self.cache_dir = Path(settings.output_dir) / LORA_CACHE_DIR
        self.live: deque[tuple[str, Path]] = deque()  # (adapter name, directory), oldest first

    @property
    def served_model(self) -> str | None:
        """The newest adapter registered: requests name it to get the trained policy."""
        return self.live[-1][0] if self.live else None

    def push(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """``WeightSync.push``: the adapter as version ``step`` (its gathers are collective: every rank calls)."""
        t = self.publish(model, adapter_state(model), step)
        return {"perf/weight_sync_s": t["write_s"] + t["load_s"] + t["retire_s"],
                "perf/weight_sync_pause_s": 0.0,  # adapters load beside the running ones: no pause
                "perf/weight_sync_transfer_s": t["write_s"] + t["load_s"]}  # fmt: skip

    def close(self) -> None:
        """Nothing is held between calls; the registered versions stay for the run's last samples."""

    def _call(self, url: str, coro_fn: Any, what: str, timeout_s: float | None = None) -> Any:
        """Run one async client call to completion (the trainer thread has no event loop of its own)."""
        limit = self.settings.timeout_s if timeout_s is None else timeout_s

        async def go() -> Any:
            client = self.connect(url)
            try:
                return await asyncio.wait_for(coro_fn(client), limit + 5.0)
            finally:
                await client.close()

        try:
            return asyncio.run(go())
        except TimeoutError:
            raise TimeoutError(f"timed out after {limit:.0f}s waiting for {what} at {url}") from None

    def clear_leftovers(self, loaded: list[str]) -> None:
        """Unload adapters an earlier run of this prefix left on the server and empty the cache directory."""
        mine = [n for n in loaded if n.startswith(self.settings.prefix + "-step-")]
        for name in mine:
            logger.info("unloading LoRA adapter %r left on the server by an earlier run", name)
            self._unload(name)
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    def publish(self, model: torch.nn.Module, state: dict[str, torch.Tensor], version: int) -> dict[str, float]:
        """Write and register version ``version``, then retire versions outside the window; returns timings."""
        t0 = time.perf_counter()
        name = self.adapter_name(self.settings.prefix, version)
        path = self.cache_dir / name
        if any(n == name for n, _ in self.live):  # the same version again (e.g. re-sync after resume)
            self._retire(name, path)
            self.live = deque((n, p) for n, p in self.live if n != name)
        write_adapter(model, state, path)
        t1 = time.perf_counter()
        for url in self.settings.base_urls:
            try:
                self._load(url, name, path)
            except ServerError as exc:
                if exc.status == 404:
                    raise RuntimeError(f"the server at {url} has no /v1/load_lora_adapter: {RUNTIME_LORA_HINT}"
                                       ) from exc  # fmt: skip
                raise RuntimeError(f"the server at {url} refused LoRA adapter {name} ({path}): {exc}") from exc
        self.live.append((name, path))
        t2 = time.perf_counter()
        while len(self.live) > self.settings.max_staleness + 1:
            self._retire(*self.live.popleft())
        return {"write_s": t1 - t0, "load_s": t2 - t1, "retire_s": time.perf_counter() - t2}

    def _load(self, url: str, name: str, path: Path) -> None:
        """Register one version; a server that does not answer is waited for (``restart_timeout_s``), once."""
        load = lambda c: c.load_lora_adapter(name, str(path.resolve()))
        try:
            self._call(url, load, f"POST /v1/load_lora_adapter {name}")
            return
        except ServerError as exc:
            if exc.status is not None or self.settings.restart_timeout_s <= 0:
                raise
            logger.warning("server %s did not answer loading adapter %s (%s): waiting up to %.0fs for it to come "
                           "back", url, name, exc, self.settings.restart_timeout_s)  # fmt: skip
        self._call(url, lambda c: c.wait_until_ready(self.settings.restart_timeout_s), "GET /health (restart)",
                   timeout_s=self.settings.restart_timeout_s + 10)  # fmt: skip
        self._call(url, load, f"POST /v1/load_lora_adapter {name}")

    def _unload(self, name: str) -> None:
        for url in self.settings.base_urls:
            try:
                self._call(url, lambda c: c.unload_lora_adapter(name), f"POST /v1/unload_lora_adapter {name}")
            except ServerError as exc:
                if exc.status != 404:  # 404: not there (e.g. the server restarted, or loaded on another server)
                    raise

    def _retire(self, name: str, path: Path) -> None:
        self._unload(name)
        shutil.rmtree(path, ignore_errors=True)
        logger.debug("retired LoRA adapter %s", name)


class AdapterFollower:
    """A trainer process other than rank 0 under adapter sync: it joins the adapter's gathers (FSDP2), no more."""

    backend = "adapter"
    served_model: str | None = None

    def push(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        adapter_state(model)  # collective under FSDP2: the same gathers, in the same order, as rank 0's
        return {}

    def close(self) -> None:
        """Nothing to leave."""


def start_adapter_sync(
    model: torch.nn.Module,
    settings: AdapterSyncSettings,
    facts: tuple[int, int, Sequence[str]],
    save_strategy: Any,
    connect: Callable[[str], ServerControl],
    adapter_name: Callable[[str, int], str],
) -> AdapterPublisher:
    """Rank 0 at ``train()`` start: check the server's LoRA limits (``facts``: ``--max-lora-rank``, ``--max-loras``
    and the adapters the server lists now), warn when nothing will be kept, unload what an earlier run of this
    prefix left and return the publisher (``connect`` and ``adapter_name`` as :class:`AdapterPublisher`'s)."""
    max_lora_rank, max_loras, loaded = facts
    mine = settings.prefix + "-step-"
    others = [n for n in loaded if not n.startswith(mine)]
    check_adapter_server(adapter_rank(model), settings.max_staleness, max_lora_rank, max_loras, others)
    warn_nothing_kept(save_strategy)
    publisher = AdapterPublisher(settings, connect, adapter_name)
    publisher.clear_leftovers(list(loaded))
    return publisher

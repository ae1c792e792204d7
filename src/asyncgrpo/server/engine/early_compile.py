"""The engine's Triton kernels compiled in a thread while the model loads (CUDA, native model families only).

Why: on an empty Triton cache the sampler's kernels and the kernel self-checks compile for 7-10 s on an H200
(``sampler`` 4.6-6.2 s, ``kernels`` 2.9-3.5 s of the engine's start), right after a model load whose seconds
are mostly Python imports. Much of a Triton compile runs outside the interpreter lock (LLVM, ptxas), so beside the
load it mostly overlaps: on an H200, load then compile took 12.5 s, the two side by side 8.5 s.

It compiles what the engine compiles anyway: the same warm-up and self-check functions, for the sizes and dtype
the checkpoint's ``config.json`` names (read as JSON: transformers is not imported yet). The engine still runs
them at their usual place and keeps their verdicts; here they only fill Triton's caches. A verdict of the thread is
undone (the kernels' switches are put back, its log lines dropped), so a wrong guess of the sizes costs the
thread's time and nothing else. The engine joins the thread before it plans the KV cache; what the thread leaves
on the GPU (its kernels' code, a cuBLAS workspace the engine thread reuses later, a few cached MiB) counts as used
in that plan, where it came after the plan before: the KV cache can come out some tens of MiB smaller (about 0.1 %
at a 0.3 share of an H200). On CPU nothing here runs (no CUDA call).

Only on a cold cache: where Triton's cache folder holds every kernel already, loading them is Python work that
would only take the interpreter lock from the imports beside it (on the H200 a warm start took 9.4-9.6 s with the
thread, 7.5 s without), so the engine loads them at their usual place.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

logger = logging.getLogger(__name__)

THREAD_NAME = "engine-early-compile"
LOG_EVERY_S = 30.0
_QUIET = ("asyncgrpo.server.layers.sample_kernel", "asyncgrpo.server.layers.fused",
          "asyncgrpo.server.layers.attention", "asyncgrpo.triton_support")  # fmt: skip
_KERNELS = (
    "slice_kernel",
    "combine_kernel",
    "qkv_rope_kernel",
    "add_rms_norm_kernel",
    "silu_mul_kernel",
    "_paged_decode_kernel",
)  # what the thread compiles (the Triton functions' names)
_KERNEL_MODULES = ("asyncgrpo.server.layers.attention", "asyncgrpo.server.layers.fused",
                   "asyncgrpo.server.layers.sample_kernel", "asyncgrpo.server.layers.sample_triton",
                   "asyncgrpo.server.layers.fused_triton", "asyncgrpo.server.layers.decode_kernel",
                   "asyncgrpo.server.layers.prefill_kernel")  # fmt: skip


@dataclass(frozen=True)
class Shapes:
    """What the kernels are compiled for: the model's attention sizes, vocabulary and dtype."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    dtype: torch.dtype
    qk_norm: bool
    hidden: int
    intermediate: int


def guess_shapes(model: Any, dtype: str, device: torch.device) -> Shapes | None:
    """The sizes :class:`~asyncgrpo.server.models.decoder.DecoderLM` will have, from ``config.json``; None where the
    model is no checkpoint folder of a native family (the general path compiles none of these kernels)."""
    from asyncgrpo.server.models.decoder import SUPPORTED_ARCHITECTURES, resolve_dtype

    path = os.path.join(str(model), "config.json") if isinstance(model, (str, os.PathLike)) else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            cfg = json.load(fh)
        if not any(a in SUPPORTED_ARCHITECTURES for a in cfg.get("architectures") or []):
            return None
        heads = int(cfg["num_attention_heads"])
        ckpt = SimpleNamespace(dtype=cfg.get("dtype"), torch_dtype=cfg.get("torch_dtype"))
        return Shapes(num_heads=heads, num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                      head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads), vocab=int(cfg["vocab_size"]),
                      dtype=resolve_dtype(dtype, ckpt, device), qk_norm=cfg.get("model_type") == "qwen3",
                      hidden=int(cfg["hidden_size"]), intermediate=int(cfg.get("intermediate_size") or 4 * cfg["hidden_size"]))  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.debug("no early compile: %s", exc)
        return None


class _NotFromThread(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != THREAD_NAME


class EarlyCompile:
    """The thread (see the module docstring); :meth:`join` waits for it and undoes its verdicts."""

    def __init__(self, device: torch.device, shapes: Shapes, graphs: bool) -> None:
        from asyncgrpo.server.layers import attention, fused

        self.device, self.shapes, self.graphs = device, shapes, graphs
        self.parts: dict[str, float] = {}  # seconds per group of kernels, for the engine's log line
        self._switches = [(attention.ENABLED, dict(attention.ENABLED)), (fused.ENABLED, dict(fused.ENABLED))]
        self._filter = _NotFromThread()
        for name in _QUIET:
            logging.getLogger(name).addFilter(self._filter)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from asyncgrpo.server.layers import attention, fused, sample_kernel

        s, dev = self.shapes, self.device
        group = s.num_heads // s.num_kv_heads
        t0 = last = time.monotonic()

        def part(name: str) -> None:
            nonlocal last
            now = time.monotonic()
            self.parts[name], last = round(now - last, 2), now

        try:
            torch.cuda.set_device(dev)  # Triton launches on the thread's current device
            if sample_kernel.check_kernel(dev, s.vocab, s.dtype):  # Sampler.prepare: the self-check, then the rest
                sample_kernel.warm_up(dev, s.vocab, s.dtype)
            part("sampler")
            fused.check_layer_kernels(dev, s.dtype, s.num_heads, s.num_kv_heads, s.head_dim, s.qk_norm, s.hidden,
                                      s.intermediate)  # fmt: skip
            part("layer")
            if attention.check_triton_decode(dev, s.dtype, s.num_kv_heads, group, s.head_dim) and self.graphs:
                part("decode")
                attention.check_prefill_kernel(dev, s.dtype, s.num_kv_heads, group, s.head_dim)
                part("prefill")
        except Exception as exc:  # noqa: BLE001 - the engine's own checks meet any real failure again
            logger.debug("early compile stopped: %s", exc)
        finally:  # undone by the thread itself, so an engine that fails before join() leaves nothing behind
            for switches, saved in self._switches:
                switches.update(saved)
            for name in _QUIET:
                logging.getLogger(name).removeFilter(self._filter)
        logger.debug("early compile done in %.1f s", time.monotonic() - t0)

    def join(self) -> None:
        """Wait for the thread (a line every 30 s)."""
        t0 = time.monotonic()
        while self._thread.is_alive():
            self._thread.join(timeout=LOG_EVERY_S)
            if self._thread.is_alive():
                logger.info("waiting for the early Triton compile (%.0f s so far)", time.monotonic() - t0)
        logger.info("early Triton compile beside the load: %s (waited %.1f s for it)",
                    ", ".join(f"{k} {v:.1f} s" for k, v in self.parts.items()) or "nothing", time.monotonic() - t0)  # fmt: skip


def triton_cache_looks_warm(folder: str | None = None) -> bool:
    """Whether Triton's cache folder holds a compiled module (``<key>/<name>.cubin``) of every kernel of
    ``_KERNELS``: of some sizes, not necessarily the model's, which is a guess good enough for skipping a head start.
    """
    if folder is None:
        try:
            from triton import knobs

            folder = knobs.cache.dir
        except (ImportError, AttributeError):
            folder = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    wanted = {f"{k}.cubin" for k in _KERNELS}
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir():
                    wanted.difference_update(os.listdir(entry.path))
                    if not wanted:
                        return True
    except OSError:
        return False
    return False


def start_early_compile(model: Any, dtype: str, device: str, enforce_eager: bool) -> EarlyCompile | None:
    """Start the thread where it applies: a CUDA device, Triton installed, a native checkpoint folder, a cold Triton
    cache. The device is told from the setting before anything touches CUDA: ``cpu`` returns at once."""
    if str(device).startswith("cpu") or os.environ.get("ASYNCGRPO_EARLY_COMPILE", "1") == "0":
        return None
    from asyncgrpo.triton_support import have_triton

    if not have_triton() or not torch.cuda.is_available():
        return None
    from asyncgrpo.server.models.decoder import resolve_device

    try:
        dev = resolve_device(device)
        shapes = guess_shapes(model, dtype, dev)
        if shapes is None:
            return None
        for module in _KERNEL_MODULES:  # Triton and the kernels: imported on this thread (no import-lock cycles)
            importlib.import_module(module)
        if triton_cache_looks_warm():
            return None
        return EarlyCompile(dev, shapes, graphs=not enforce_eager)
    except Exception as exc:  # noqa: BLE001 - only a head start: the engine meets any real error itself
        logger.debug("no early compile: %s", exc)
        return None

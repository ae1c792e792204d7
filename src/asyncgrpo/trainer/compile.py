"""Regional ``torch.compile`` of the decoder layers, with a fallback to eager when compiling fails.

Why regional: the packed step calls the decoder directly (``packing.attention.packed_hidden_states``), so
compiling the whole model would not reach it, and a whole-model graph would recompile for every packed
length. Compiling each decoder layer instead fuses the elementwise work HF runs as separate kernels (RMSNorm
in fp32, RoPE, SiLU x up, residual adds) while the matmuls and the tree-attention kernels stay as they are.
Every layer of a model shares one compiled graph (dynamo inlines the module, parameters are graph inputs),
and ``dynamic=True`` marks the token count symbolic so a new row length does not recompile. Python floats stay
constants while dynamo traces (``specialize_float``): ``dynamic=True`` alone makes module attributes such as
RMSNorm's ``variance_epsilon`` symbolic, which dynamo's float pass then cannot keep, and it traces the layer a
second time with them constant: 3.5 of the 4.5 s a warm-cache compile took on an H200 (bench/LOG.md, issue 41).

A compile error (no C compiler, an unsupported op, a backend bug) shows up at the first call: the layer
that hit it, and every other compiled layer, turn back to eager with one warning, and training goes on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncgrpo.triton_support import have_triton, warn_missing

logger = logging.getLogger(__name__)

__all__ = [
    "CompileSettings", "compile_decoder_layers", "compile_for_training", "decoder_layers", "start_compile_workers",
    "uncompile_decoder_layers", "wants_compiled_layers",
]  # fmt: skip


def wants_compiled_layers(args: Any, peft: bool, router_replay: Any) -> bool:
    """``compile_decoder_layers`` as set, or when None: one CUDA process with Triton, no adapter, no routing
    replay (the cases the H200 measurements cover; elsewhere eager stays the safe choice)."""
    if args.compile_decoder_layers is not None:
        return bool(args.compile_decoder_layers)
    on_cuda = torch.device(args.device).type == "cuda"
    return on_cuda and have_triton() and args.world_size == 1 and not peft and router_replay is None


def start_compile_workers(args: Any, peft: bool) -> bool:
    """Start inductor's Triton compile workers now, before the model loads, where the layers will be compiled on CUDA.

    Why: inductor starts its worker pool at the first compile and, until the pool answers, compiles each Triton
    kernel in the calling process, one after the other: a cold cache's first compile of the layer (forward and
    backward, 10.7 s of code generation on an H200) ran mostly serial. Started here, the workers come up while the
    model and the tokenizer load. Returns whether they were asked for (torch's ``TORCH_WARM_POOL=0`` still vetoes).
    """
    if torch.device(args.device).type != "cuda" or not wants_compiled_layers(args, peft, router_replay=None):
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without the pool: inductor compiles in this process as before
        return False
    maybe_warm_pool()
    return True


@dataclass(frozen=True)
class CompileSettings:
    """How to compile the decoder layers.

    Attributes:
        backend: ``torch.compile`` backend ("inductor" fuses kernels; "aot_eager" only checks tracing).
        mode: ``torch.compile`` mode (None, "default", "max-autotune-no-cudagraphs", ...).
        dynamic: symbolic sizes, so rows of new lengths reuse the compiled graph.
        memory_budget: torch's ``activation_memory_budget`` for the layers' forward/backward split: the share of
            the activations kept for the backward (the cheapest rest is recomputed there); None: torch's setting.
    """

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    dynamic: bool = True
    memory_budget: float | None = None


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder-layer list of a transformers causal LM (through a PEFT wrapper too).

    Raises:
        ValueError: when the model has no ``layers`` list under its decoder (say which model to use instead).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else getattr(base, "base_model", base)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"{type(base).__name__}: found no decoder layer list at get_decoder().layers to compile; "
            "set compile_decoder_layers=False for this model"
        )
    return layers


def _constant_floats() -> contextlib.AbstractContextManager[Any]:
    """Python floats traced as constants, for the calls of the compiled layers only (the process's other compiles
    keep torch's setting); a no-op on a torch without the switch."""
    config = torch._dynamo.config
    return config.patch(specialize_float=True) if hasattr(config, "specialize_float") else contextlib.nullcontext()


def _memory_budget(budget: float | None) -> contextlib.AbstractContextManager[Any]:
    """The partitioner's activation budget while the layers compile (they compile inside their calls); a no-op
    when None."""
    if budget is None:
        return contextlib.nullcontext()
    import torch._functorch.config as functorch_config

    return functorch_config.patch(activation_memory_budget=budget)


class _GuardedCall:
    """A layer's compiled ``__call__`` that turns every guarded layer back to eager on the first failure."""

    def __init__(
        self, owner: _CompiledLayers, module: torch.nn.Module, compiled: Callable[..., Any], budget: float | None = None
    ) -> None:
        self.owner, self.module, self.compiled = owner, module, compiled
        self.floats = _constant_floats()  # one reusable patch (3-4 us a call, ~0.1 ms a forward of 30 layers)
        self.budget = _memory_budget(budget)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.owner.failed is not None:
            return self.module._call_impl(*args, **kwargs)
        try:
            with self.floats, self.budget:
                return self.compiled(*args, **kwargs)
        except Exception as exc:
            if not _is_compile_error(exc):
                raise
            self.owner.fail(exc)
            return self.module._call_impl(*args, **kwargs)


def _is_compile_error(exc: BaseException) -> bool:
    """Errors raised by dynamo/inductor/a backend, as opposed to errors of the model code itself."""
    from torch._dynamo.exc import BackendCompilerFailed, TorchDynamoException

    if isinstance(exc, (BackendCompilerFailed, TorchDynamoException)):
        return True
    mod = type(exc).__module__ or ""
    return mod.startswith(("torch._dynamo", "torch._inductor", "torch._functorch", "triton"))


def _is_compiled(layer: torch.nn.Module) -> bool:
    """Whether :func:`compile_decoder_layers` compiled ``layer`` (and :func:`uncompile_decoder_layers` has not undone it)."""
    return isinstance(getattr(layer, "_compiled_call_impl", None), _GuardedCall)


class _CompiledLayers:
    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self.layers = list(layers)
        self.failed: BaseException | None = None
        self._lock = threading.Lock()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.failed is not None:
                return
            self.failed = exc
        logger.warning(
            "torch.compile of the decoder layers failed (%s: %s); running them eager from now on. Set "
            "compile_decoder_layers=False to skip the attempt.",
            type(exc).__name__,
            _first_line(getattr(exc, "inner_exception", None) or exc.__cause__ or exc),
        )
        for layer in self.layers:
            layer._compiled_call_impl = None


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text.splitlines()[0][:300]


def compile_decoder_layers(model: torch.nn.Module, settings: CompileSettings | None = None) -> int:
    """Compile each decoder layer's ``__call__`` in place; returns the number of layers compiled.

    Idempotent (already compiled layers are left alone). Works under gradient checkpointing (the recompute
    runs the compiled layer again) and under FSDP2 (the layer's hooks stay outside the compiled region when
    transformers checkpoints ``forward``).
    """
    settings = settings or CompileSettings()
    on_cuda = any(p.device.type == "cuda" for p in model.parameters())
    if settings.backend == "inductor" and on_cuda and not have_triton():  # inductor's CUDA code is Triton
        warn_missing("compile_decoder_layers on CUDA")
        return 0
    layers = decoder_layers(model)
    todo = [layer for layer in layers if not _is_compiled(layer)]
    if not todo:
        return 0
    group = _CompiledLayers(layers)
    for layer in todo:
        compiled = torch.compile(
            layer._call_impl, backend=settings.backend, mode=settings.mode, dynamic=settings.dynamic
        )
        layer._compiled_call_impl = _GuardedCall(group, layer, compiled, settings.memory_budget)
    # one graph serves every layer; leave room for a few specialisations (e.g. with/without gradients)
    cfg = torch._dynamo.config
    cfg.cache_size_limit = max(cfg.cache_size_limit, 64, 8 * len(layers))
    if hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 4 * len(layers) + 64)
    logger.info("compiled %d decoder layers (backend=%s, dynamic=%s)", len(todo), settings.backend, settings.dynamic)
    return len(todo)


def compile_for_training(
    model: torch.nn.Module, args: Any, peft: bool, router_replay: Any, backend: str = "inductor"
) -> int:
    """The trainer's compile, where :func:`wants_compiled_layers`: the layers with ``args.activation_memory_budget``,
    which then replaces transformers' whole-layer checkpointing (turned off on ``args``, where transformers reads it
    at ``train()``). Returns the number of layers compiled."""
    budget = getattr(args, "activation_memory_budget", None)
    wanted = wants_compiled_layers(args, peft, router_replay)
    n = compile_decoder_layers(model, CompileSettings(backend=backend, memory_budget=budget)) if wanted else 0
    if budget is None:
        return n
    if not any(_is_compiled(layer) for layer in decoder_layers(model)):
        logger.warning("activation_memory_budget=%s needs compiled decoder layers, which are off here: it is ignored "
                       "and gradient_checkpointing stays as set", budget)  # fmt: skip
        return n
    for name in ("gradient_checkpointing", "activation_checkpointing"):  # transformers >= 5.2x reads the second
        if getattr(args, name, None):
            setattr(args, name, False)
    logger.info("compiled decoder layers keep %.0f %% of their activations for the backward and recompute the rest "
                "(activation_memory_budget=%s) instead of checkpointing whole layers", 100 * budget, budget)  # fmt: skip
    return n


def uncompile_decoder_layers(model: torch.nn.Module) -> None:
    """Undo :func:`compile_decoder_layers` (the layers run eager again)."""
    for layer in decoder_layers(model):
        if _is_compiled(layer):
            layer._compiled_call_impl = None

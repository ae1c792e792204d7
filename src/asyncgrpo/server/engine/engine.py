"""The embedded generation engine in this process: the facade over a thread that steps a continuous batch.

Named "the engine" because it is what callers hold (the HTTP layer, through ``api.EngineAPI``); the thread
and its step loop are ``loop.py``, and ``process.py`` runs this same class in a process of its own. All model,
cache and sampler work happens on the engine thread. Public methods are thread-safe: they put a command
(``commands.py``) on a queue that the engine thread drains between two steps, and the blocking ones
(``pause``, ``run_between_steps``) wait for its answer. Finished requests are
handed back through their ``on_finish`` callback, called on the engine thread.

Defaults: ``max_model_len`` = min(config.max_position_embeddings, 4096); the
prefill token budget per step = max(16384, max_model_len); KV capacity as in
:mod:`kv_cache`. See :mod:`scheduler` for the batching policy and :mod:`sampler`
for the sampling rules and seeds.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from asyncgrpo.server.engine.commands import Abort, AddSequence, Pause, Resume, RunCall
from asyncgrpo.server.engine.general_runner import GeneralRunner
from asyncgrpo.server.engine.kv_cache import (
    KVCache,
    activation_headroom_bytes,
    kv_bytes_per_token,
    plan_num_blocks,
)
from asyncgrpo.server.engine.loop import EngineLoop
from asyncgrpo.server.engine.lora import LoRAManager
from asyncgrpo.server.engine.request import EngineStats, PauseMode, Request, RequestOutput, validate_request
from asyncgrpo.server.engine.routing_capture import RoutingCapture
from asyncgrpo.server.engine.row_prefill import ROW_BUCKETS
from asyncgrpo.server.engine.runner import ModelRunner
from asyncgrpo.server.engine.sampler import Sampler
from asyncgrpo.server.engine.scheduler import Scheduler, Sequence
from asyncgrpo.server.engine.settings import EngineSettings, ReceiverSettings
from asyncgrpo.server.engine.weight_receiver import WeightReceiver
from asyncgrpo.server.models.decoder import DecoderLM
from asyncgrpo.server.models.hf import GeneralLM, is_native, load_any_model, text_model_aliases
from asyncgrpo.server.start_clock import StartClock
from asyncgrpo.weights.ipc import device_uuid

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_PREFILL_TOKENS = 16384  # per-step prefill token budget (raised to max_model_len if smaller)


class Engine:
    """Continuous-batching generation over a paged KV cache, in this process (see the module docstring).

    The facade over the engine thread (:class:`~asyncgrpo.server.engine.loop.EngineLoop`): it builds model,
    cache, scheduler, runner and sampler from one :class:`EngineSettings`, checks requests before they are
    queued, and turns each call into a command for the thread. :class:`~asyncgrpo.server.engine.process.
    RemoteEngine` offers the same members (:class:`~asyncgrpo.server.engine.api.EngineAPI`) from another process.

    Args:
        model: HF checkpoint directory of a causal LM or a vision-language checkpoint (served text-only), or an
            already-built ``PreTrainedModel`` (its weights are used in place). Llama/Mistral/Qwen2/Qwen3 run
            our own forward (``models/decoder.py``); every other family runs its HF forward (``models/hf.py``).
        settings: how to build it (:class:`EngineSettings`); or give its fields as keywords instead.
    """

    # what it was built with (EngineAPI); set in __init__
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    kv_cache_tokens: int
    max_num_seqs: int
    device: torch.device
    dtype: torch.dtype
    gpu_uuid: str | None
    pid: int
    routing: RoutingCapture | None = None  # --enable-return-routed-experts
    start_s: dict[str, float]  # seconds per start phase (start_clock.py), "total" included
    start_parts_s: dict[str, dict[str, float]]  # the parts of the phases that time them (start_clock.py)

    def __init__(
        self,
        model: str | os.PathLike | Any,
        settings: EngineSettings | None = None,
        *,
        clock: StartClock | None = None,
        **options: Any,
    ) -> None:
        if settings is not None and options:
            raise TypeError(f"pass EngineSettings or its fields as keywords, not both (got {sorted(options)})")
        s = self.settings = settings if settings is not None else EngineSettings(**options)
        clock = clock or StartClock(from_process=False)  # the engine process's own clock counts its imports too
        dtype, device, max_model_len, max_num_seqs = s.dtype, s.device, s.max_model_len, s.max_num_seqs
        seed, kv_cache_tokens, gpu_memory_utilization, block_size = (
            s.seed, s.kv_cache_tokens, s.gpu_memory_utilization, s.block_size)  # fmt: skip
        enable_lora, max_lora_rank, max_loras, enforce_eager = (
            s.enable_lora, s.max_lora_rank, s.max_loras, s.enforce_eager)  # fmt: skip
        max_num_batched_tokens, enable_prefix_caching = s.max_num_batched_tokens, s.enable_prefix_caching
        if (max_num_seqs is not None and max_num_seqs < 1) or block_size < 1:
            raise ValueError(f"max_num_seqs ({max_num_seqs}) and block_size ({block_size}) must be >= 1")
        hf = load_any_model(model, dtype, device, clock.part)
        self.hf_config = hf.config
        cfg = hf.config.get_text_config()  # a vision-language config keeps its sizes in text_config
        self.general_path = not is_native(hf)
        if self.general_path and enable_lora:
            raise ValueError(
                f"--enable-lora is not supported for {type(hf).__name__}: the embedded server runs it through the "
                "general (HF forward) path, which has no runtime adapters; sync merged weights instead (no "
                "--enable-lora), or use a vLLM server"
            )
        limit = getattr(cfg, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
        self.max_model_len = int(max_model_len or min(limit, DEFAULT_MAX_MODEL_LEN))
        if self.max_model_len > limit:
            logger.warning("max_model_len %d exceeds max_position_embeddings %d", self.max_model_len, limit)
        if s.enable_return_routed_experts:  # a dense model (every native one is dense) is refused, as vLLM does
            self.routing = RoutingCapture(hf, cfg)
            if not self.general_path:
                raise ValueError(f"--enable-return-routed-experts: {type(hf).__name__} has no MoE router to capture")
        self._model = GeneralLM(hf) if self.general_path else DecoderLM(hf, self.max_model_len)
        clock.part("native_model")
        self.dtype = self._model.dtype
        self.device = self._model.device
        self.gpu_uuid = device_uuid(self.device) if self.device.type == "cuda" else None  # ipc: same GPU as a trainer?
        self.pid = os.getpid()
        self._receiver: WeightReceiver | None = None
        max_num_seqs = max_num_seqs or default_max_num_seqs(self.device)
        self.max_num_seqs = max_num_seqs
        self.vocab_size = self._model.vocab_size
        self.eos_token_ids = _eos_ids(hf)
        self.block_size = block_size
        clock.mark("load")

        budget = max_num_batched_tokens or max(DEFAULT_PREFILL_TOKENS, self.max_model_len)
        if budget < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({budget}) must be >= max_model_len ({self.max_model_len})")
        m = self._model
        elem = torch.empty((), dtype=self.dtype).element_size()
        prefill_rows = min(ROW_BUCKETS[-1], budget)  # the largest row-wise prefill graph (row_prefill.py)
        self.num_blocks, kv_why = plan_num_blocks(
            block_size=block_size,
            bytes_per_token=kv_bytes_per_token(
                m.num_kv_layers if self.general_path else len(m.layers), m.num_kv_heads, m.head_dim, self.dtype
            ),
            device=self.device,
            kv_cache_tokens=kv_cache_tokens,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            headroom_bytes=activation_headroom_bytes(
                cfg.hidden_size,
                getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
                self.vocab_size,
                budget + (0 if enforce_eager else prefill_rows),  # + the prefill graphs' pool
                max_num_seqs,
                elem,
            ),
        )
        self.kv_cache_tokens = self.num_blocks * block_size
        if self.kv_cache_tokens < self.max_model_len:
            raise ValueError(
                f"KV cache holds {self.kv_cache_tokens} tokens < max_model_len {self.max_model_len}: one sequence "
                "could never finish; raise kv_cache_tokens or lower max_model_len"
            )
        if enable_prefix_caching and self.general_path:
            logger.info("prefix caching is off on the general (HF forward) model path: it keeps its own HF caches")
        self.enable_prefix_caching = enable_prefix_caching and not self.general_path
        self._kv = KVCache(
            len(m.layers), self.num_blocks, block_size, m.num_kv_heads, m.head_dim, self.dtype, self.device,
            enable_prefix_caching=self.enable_prefix_caching,
        )  # fmt: skip
        clock.mark("kv")
        self._scheduler = Scheduler(self._kv, max_num_seqs, budget)
        if self.general_path:  # KVCache above holds no tensors (m.layers is empty): block accounting only
            self._runner = GeneralRunner(m, self._kv, self.routing)
        else:
            self._runner = ModelRunner(m, self._kv, max_num_seqs, self.max_model_len, use_graphs=not enforce_eager,
                                       max_prefill_rows=prefill_rows, lazy_graphs=s.cuda_graph_capture == "lazy")  # fmt: skip
        sampler = Sampler(self.device, seed)
        sampler.prepare(self.vocab_size, self.dtype)  # compiles the sampling kernels now, not in the first step
        clock.mark("sampler")
        self._lora = LoRAManager(enabled=enable_lora, max_rank=max_lora_rank, max_loras=max_loras, model=m)
        self._runner.check_kernels()
        clock.mark("kernels")
        self._runner.capture_graphs()
        clock.mark("graphs")
        self._params = dict(hf.named_parameters(remove_duplicate=False))  # tied lm_head.weight listed too
        self._params.update(text_model_aliases(self._params))  # a VLM's text weights under causal-LM names too

        self._core = EngineLoop(self._scheduler, self._runner, sampler, self.eos_token_ids, self.max_model_len)
        self._core.on_release = self._release_id
        self._live_ids: set[str] = set()  # submit-side view of requests in flight, for duplicate ids
        self._ids_lock = threading.Lock()
        self.start_s = {**clock.phases, "total": clock.since_start()}  # /server_info: asyncgrpo.start_s
        self.start_parts_s = {k: dict(v) for k, v in clock.parts.items()}
        logger.info("engine ready: %s on %s (%s), max_model_len %d, KV cache %d tokens = %s in %d blocks; started in "
                    "%.1f s (%s)", m.arch, self.device, self.dtype, self.max_model_len, self.kv_cache_tokens, kv_why,
                    self.num_blocks, self.start_s["total"], clock.text())  # fmt: skip

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the engine thread (daemon). Idempotent.

        The objects built so far (the model's modules, graphs, tables) are moved out of the garbage collector's
        scans first (``gc.freeze``, as vLLM does after start-up): a full collection that walks them stalls the
        step loop for tens of milliseconds at random, and a decoding engine allocates fast enough to trigger one.
        """
        if not self._core.running():
            gc.collect()
            gc.freeze()
        self._core.start()

    def shutdown(self) -> None:
        """Abort what is in flight, stop the thread and release the KV cache and graphs (and hand the heap frozen
        by :meth:`start` back to the garbage collector)."""
        self._core.stop()
        gc.unfreeze()
        self._core.runner = None  # type: ignore[assignment]
        self._runner = None  # type: ignore[assignment]
        self._kv.layers = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def is_alive(self) -> bool:
        """True while the engine thread runs (False before :meth:`start` and after :meth:`shutdown`)."""
        return self._core.running()

    @property
    def weight_version(self) -> str:
        return self._core.weight_version

    # ----------------------------------------------------------------- requests
    def submit(self, request: Request, on_finish: Callable[[RequestOutput], None]) -> None:
        """Queue a request; ``on_finish`` is called once, on the engine thread. ValueError for a bad request."""
        self._validate(request)
        lora = None
        if request.lora_name is not None:
            try:
                lora = self._lora.get(request.lora_name)
            except KeyError:
                raise ValueError(f"LoRA adapter {request.lora_name!r} was unloaded") from None
        with self._ids_lock:
            if request.request_id in self._live_ids:
                raise ValueError(f"request_id {request.request_id!r} is already in flight; ids must be unique")
            self._live_ids.add(request.request_id)
        self._core.send(AddSequence(Sequence(request=request, on_finish=on_finish, lora=lora)))

    def abort(self, request_id: str) -> None:
        """Finish a request with finish_reason "abort", keeping its tokens so far. Unknown ids are ignored."""
        self._core.send(Abort(request_id))

    def _validate(self, request: Request) -> None:
        validate_request(request, self.max_model_len, self.vocab_size, self._lora.names)

    # ------------------------------------------------------------ pause / calls
    def pause(self, mode: PauseMode, timeout: float | None = None, *, clear_cache: bool = True) -> None:
        """Pause per ``mode`` ("abort", "wait", "keep"; see the HTTP protocol) and return once in effect.

        ``clear_cache`` (vLLM's default) makes a ``keep`` pause preempt the frozen sequences: their KV is
        recomputed on resume. With ``clear_cache=False`` they keep their KV in place.
        """
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        self._core.call(Pause(mode, clear_cache), timeout)

    def resume(self) -> None:
        self._core.call(Resume(), None)

    def pause_future(self, mode: PauseMode, *, clear_cache: bool = True) -> Future:
        """:meth:`pause` without blocking the caller: the future is done once the pause is in effect (an event loop
        awaits it with ``asyncio.wrap_future`` instead of parking an executor thread on it)."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}")
        return self._core.send(Pause(mode, clear_cache))

    def resume_future(self) -> Future:
        """:meth:`resume` without blocking the caller."""
        return self._core.send(Resume())

    def between_steps_future(self, fn: Callable[[], T]) -> Future:
        """:meth:`run_between_steps` without blocking the caller: the future holds ``fn``'s result or error."""
        if threading.current_thread() is self._core.thread:
            fut: Future = Future()
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the future's awaiter
                fut.set_exception(exc)
            return fut
        return self._core.send(RunCall(fn))

    @property
    def is_paused(self) -> bool:
        return self._core.pause_mode is not None

    @property
    def pause_mode(self) -> PauseMode | None:
        return self._core.pause_mode

    def run_between_steps(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run ``fn`` on the engine thread between two steps and return its result (re-raising its error)."""
        if threading.current_thread() is self._core.thread:
            return fn()
        return self._core.call(RunCall(fn), timeout)

    def _release_id(self, request_id: str) -> None:
        with self._ids_lock:
            self._live_ids.discard(request_id)
        if self.general_path and self._runner is not None:  # engine thread: free its HF cache now, not next step
            self._runner.release_finished()

    # --------------------------------------------------------- weights & LoRA
    def weight_receiver(self, settings: ReceiverSettings) -> WeightReceiver:
        """The receiving side of the weight transfer, beside these weights; built on the first call."""
        if self._receiver is None:
            self._receiver = WeightReceiver(self, settings)
        return self._receiver

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Parameters under their HF checkpoint names (unfused; a tied lm_head is not listed)."""
        yield from self._model.hf_model.named_parameters()

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of every name :meth:`load_weights` accepts (HF names, tied and text-model aliases included)."""
        return {name: tuple(p.shape) for name, p in self._params.items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the parameters by HF name, in place. Call via :meth:`run_between_steps`."""
        unknown, loaded = [], 0
        with torch.no_grad():
            for name, tensor in weights:
                param = self._params.get(name)
                if param is None:
                    unknown.append(name)
                    continue
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}; expected {tuple(param.shape)}")
                param.copy_(tensor)
                loaded += 1
        if loaded:
            self._kv.reset_prefix_cache()  # cached K/V was computed with the old weights
        if unknown:
            raise ValueError(f"unknown weight names {unknown[:10]} ({len(unknown)} total); {loaded} were loaded")

    def set_weight_version(self, version: str) -> None:
        """Tokens generated from now on are labelled with ``version``."""
        self._core.weight_version = str(version)

    def preempt_for_new_weights(self) -> None:
        """On the engine thread (inside :meth:`run_between_steps`): a ``keep`` pause's effect on the running requests
        without the pause, for a job that loads new weights between two steps (``round_step.py``)."""
        self._core.preempt_for_new_weights()

    def reset_prefix_cache(self, timeout: float | None = 60.0) -> bool:
        """Forget every cached prefix block (on the engine thread, between steps). Always succeeds: blocks
        still used by running requests only lose their key."""
        self.run_between_steps(self._kv.reset_prefix_cache, timeout)
        return True

    def reset_prefix_cache_future(self) -> Future:
        """:meth:`reset_prefix_cache` without blocking the caller."""
        return self.between_steps_future(self._kv.reset_prefix_cache)

    def load_lora(self, name: str, path: str) -> None:
        self._lora.load(name, path)
        self.reset_prefix_cache()

    def unload_lora(self, name: str) -> None:
        self._lora.unload(name)
        self.reset_prefix_cache()

    @property
    def lora_names(self) -> list[str]:
        return self._lora.names

    @property
    def look_ahead(self) -> bool:
        """Decode one step ahead in steady decode phases (on by default; off = one synchronous step at a time)."""
        return self._core.look_ahead

    @look_ahead.setter
    def look_ahead(self, on: bool) -> None:
        self._core.look_ahead = bool(on)

    @property
    def decode_backend(self) -> str:
        """Diagnostics: 'triton+cuda-graphs', 'triton-eager' or 'torch-eager' (CPU, or a fallback after an error)."""
        return self._runner.backend

    def step_timings(self) -> dict[str, dict[str, float]]:
        """Diagnostics: number of prefill/decode steps so far, their total wall seconds, and when the last one ended
        (Unix time, to time what happens after the engine's work, e.g. the answer path's tail); for decode also how
        many steps were launched ahead (before the previous step's results reached the host)."""
        c = self._core
        out = {
            k: {"steps": c.step_counts[k], "seconds": c.step_seconds[k], "last_end_unix": c.step_last_end_unix[k]}
            for k in c.step_counts
        }
        out["decode"]["steps_ahead"] = c.decode_steps_ahead
        return out

    def stats(self) -> EngineStats:
        s = self._scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_cache_usage=self._kv.usage,
            num_preemptions_total=s.num_preemptions,
            prompt_tokens_total=self._core.prompt_tokens,
            generation_tokens_total=self._core.generation_tokens,
            prefix_cache_queries_total=s.prefix_cache_queries,
            prefix_cache_hits_total=s.prefix_cache_hits,
            prefill_tokens_computed_total=s.prefill_tokens_computed,
        )


def default_max_num_seqs(device: torch.device) -> int:
    """vLLM's server default: 1024 sequences on GPUs with at least 70 GiB (H100/H200 class, A100 excluded: vLLM
    found large batches slower there), 256 elsewhere. GRPO keeps hundreds of requests in flight, so the smaller
    limit would queue half of them."""
    if device.type != "cuda":
        return 256
    props = torch.cuda.get_device_properties(device)
    return 1024 if props.total_memory >= 70 * 2**30 and "a100" not in props.name.lower() else 256


def _eos_ids(hf) -> list[int]:
    """EOS ids of the config and of the generation config, deduplicated, in order."""
    found: list[int] = []
    for src in (hf.config, hf.config.get_text_config(), getattr(hf, "generation_config", None)):
        eos = getattr(src, "eos_token_id", None) if src is not None else None
        for t in [eos] if isinstance(eos, int) else list(eos or []):
            if t not in found:
                found.append(int(t))
    return found

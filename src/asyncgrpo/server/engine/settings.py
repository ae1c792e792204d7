"""The settings records of the engine and of its weight receiver.

One frozen record per part, built once from the command line (``server/main.py``) and handed down as it is:
the in-process engine reads it, the process engine pickles it to its child, so the two cannot drift apart the
way two keyword dicts could. Defaults are the engine's (and, where vLLM has the flag, vLLM's).
"""

from __future__ import annotations

from dataclasses import dataclass

CHECK_MODES = ("vllm", "strict")
GRAPH_CAPTURE_MODES = ("lazy", "eager")


@dataclass(frozen=True)
class EngineSettings:
    """How an engine is built (everything but the model itself).

    Attributes:
        dtype: "auto" (checkpoint dtype on CUDA, float32 on CPU), "bfloat16", "float16", "float32".
        device: "auto" (CUDA when present), "cpu", "cuda", "cuda:N".
        max_model_len: longest prompt + output; None: min(max_position_embeddings, 4096).
        max_num_seqs: most sequences running at once; None: vLLM's default (1024 on a GPU with >= 70 GiB that
            is not an A100, else 256).
        seed: seed of the generator for requests without their own.
        kv_cache_tokens: KV capacity in tokens; None: from ``gpu_memory_utilization`` (CUDA).
        gpu_memory_utilization: fraction of the GPU's memory this process may use in total.
        block_size: tokens per KV block.
        enable_lora / max_lora_rank / max_loras: runtime LoRA adapters.
        enforce_eager: no CUDA graphs (decode, and small prefills run row-wise).
        cuda_graph_capture: ``lazy`` (default): capture the largest decode and prefill graphs at start and every
            other size while the engine idles (smallest first) or the first time a step needs it (that step pays
            its capture, once); ``eager``: every size before serving (a longer start). See ``engine/runner.py``.
        max_num_batched_tokens: prefill token budget per step (extension); None: max(16384, max_model_len).
        enable_prefix_caching: reuse the KV blocks of equal prompt prefixes (vLLM's default: on); every
            weight load, LoRA load/unload and prefix-cache reset empties the cache.
        enable_return_routed_experts: answer each request with the expert ids every MoE router chose for its
            tokens (vLLM 0.33's flag; mixture-of-experts models, which run the general path).
    """

    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    seed: int = 0
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.85
    block_size: int = 16
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    enforce_eager: bool = False
    cuda_graph_capture: str = "lazy"
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.cuda_graph_capture not in GRAPH_CAPTURE_MODES:
            raise ValueError(
                f"cuda_graph_capture must be one of {GRAPH_CAPTURE_MODES}, got {self.cuda_graph_capture!r}"
            )


@dataclass(frozen=True)
class ReceiverSettings:
    """How the receiving side of the weight transfer is set up.

    Attributes:
        backend: ``nccl``, ``gloo``, ``ipc`` or ``auto`` (nccl and ipc on a GPU, gloo on CPU: the server's
            ``--weight-transfer-config``); None: not configured, every step answers 500 as vLLM does without it.
        timeout_s: bound on the rendezvous and on one round's collectives.
        checks: ``vllm`` (answer errors as vLLM does) or ``strict`` (400 before any collective); see
            ``engine/weight_receiver.py``.
    """

    backend: str | None = "gloo"
    timeout_s: float = 1800.0
    checks: str = "vllm"

    def __post_init__(self) -> None:
        if self.checks not in CHECK_MODES:
            raise ValueError(f"weight-transfer checks must be one of {CHECK_MODES}, got {self.checks!r}")

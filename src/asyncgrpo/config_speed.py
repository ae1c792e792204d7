"""Config fields of the training step's speed: compiled decoder layers, the compile warm-up, CUDA graphs.

Each is on by default where the H200 measurements show it wins (one CUDA process, no adapter; bench/LOG.md,
issue 41) and off elsewhere, where eager stays the safe choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TREE_ATTENTION_BACKENDS = ("auto", "flex", "varlen", "sdpa")  # packing/attention.py's BACKENDS


@dataclass
class SpeedFields:
    compile_decoder_layers: bool | None = field(
        default=None,
        metadata={
            "help": "Compile each decoder layer with torch.compile (dynamic shapes: packed rows of any length reuse "
            "one graph), fusing the norm, RoPE and activation kernels of the packed training step. If compiling "
            "fails the layers run eager with one warning. None: on when one process trains on CUDA with Triton, "
            "without a PEFT adapter or routing replay (it halved a 135 M model's ~1k-token step on an H200)."
        },
    )
    activation_memory_budget: float | None = field(
        default=None,
        metadata={
            "help": "With compiled decoder layers: the share of each layer's activations (0-1) the compiler keeps for "
            "the backward, recomputing the cheapest rest (torch's activation_memory_budget). Set, it takes the place "
            "of gradient_checkpointing's whole-layer recompute: at the Qwen3-1.7B B2 shape on an H100, 0.25 ran 1.10 "
            "times as fast as full checkpointing in 1.5 times its memory (15.7 against 10.3 GiB), 0.5 1.18 times as "
            "fast in 2.1 times its memory (bench/LOG.md, issue 37). None: gradient_checkpointing as set. Where the "
            "layers run eager it is ignored with a warning."
        },
    )
    tree_attention_backend: str = field(
        default="auto",
        metadata={
            "help": "The packed rows' tree-attention kernel: 'flex' (FlexAttention), 'varlen' (FlashAttention over "
            "gathered trie paths), 'sdpa' (an explicit mask, any device) or 'auto': on CUDA varlen for a token_budget "
            "of 8192 or more in bf16/fp16, flex below; sdpa off CUDA. On an H100, Qwen3-0.6B ran 15 percent faster "
            "with flex at token_budget 4096, 16 percent faster with varlen at 8192 (bench/LOG.md, issue 37)."
        },
    )
    warm_up_compile: bool = field(
        default=True,
        metadata={
            "help": "On CUDA (one process), run the step's forward and backward on two dummy rows of the run's "
            "shapes right after the rollout worker starts, so the compiled kernels are built while the first groups "
            "are generated instead of inside steps 1 and 2 (`asyncgrpo train` starts it while its server starts, "
            "and stops it once the server serves; `train()` does the rest). Weights and optimizer are untouched."
        },
    )

    cuda_graph_step: bool | None = field(
        default=None,
        metadata={
            "help": (
                "Run the decoder's forward and backward of small rows as CUDA graphs (rows padded to quarters of "
                "token_budget; captured in the warm-up and checked against the eager step, which takes over with a warning "
                "if they disagree; no activation checkpointing for them). None: on for one CUDA process with Triton, no "
                "adapter, routing replay or router loss, when token_budget x parameters <= 4e12 (docs/gpus.md)."
            )
        },
    )


def speed_field_problems(cfg: Any) -> list[str]:
    """Invalid values of the fields above, each with its fix (``config_checks.config_problems``)."""
    if cfg.tree_attention_backend not in TREE_ATTENTION_BACKENDS:
        return [
            f"tree_attention_backend={cfg.tree_attention_backend!r}: must be one of {', '.join(TREE_ATTENTION_BACKENDS)}"
        ]
    return []

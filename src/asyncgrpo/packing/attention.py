"""Tree attention for transformers models, with kernels that ship inside PyTorch.

A packed row reaches the model as ``input_ids [1, T]`` and ``position_ids [1, T]``
(depth in the trie) with ``attn_implementation = "asyncgrpo_tree"``. The row's
structure travels as the keyword argument ``tree_plan`` (a :class:`TreeAttentionPlan`):
transformers passes unknown keyword arguments of ``model(...)`` down to every
attention call, and gradient checkpointing binds them into the recomputed
forward, so no global state is needed.

Backends (``TreeAttentionPlan.backend``):

- ``"sdpa"``: explicit [T, T] boolean mask + ``scaled_dot_product_attention``; any
  device, any dtype; memory O(T^2), meant for CPU and tests.
- ``"flex"``: FlexAttention (compiled) with a block mask built from the trie at
  128-token block granularity; CUDA. Fastest on rows of a few thousand tokens.
- ``"varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention inside
  torch) with one variable-length sequence per trie segment whose keys/values are
  the gathered tokens of the segment's root-to-leaf path, widened to the query heads
  (``path_gather.py`` says why); CUDA, bf16/fp16. Fastest on long rows: "auto" picks it
  from ``VARLEN_FROM_TOKENS`` tokens a row (``resolve_backend``).

A mask function is registered under the same name so transformers does not
build a dense mask for packed rows; for ordinary (unpacked) calls without a plan
the model falls back to transformers' SDPA attention with its usual mask.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from asyncgrpo.packing.deltanet import install_tree_linear_attention, needs_linear_plan
from asyncgrpo.packing.linear_attention import DEFAULT_CHUNK, LinearTreePlan, build_linear_plan
from asyncgrpo.packing.path_gather import path_gather, path_order
from asyncgrpo.packing.row import PackedRow
from asyncgrpo.triton_support import INSTALL_HINT, have_triton, warn_missing

logger = logging.getLogger(__name__)

TREE_ATTENTION = "asyncgrpo_tree"
BACKENDS = ("auto", "sdpa", "flex", "varlen")
FLEX_BLOCK = 128  # FlexAttention's sparse block size (tokens per block side)
# "auto" runs varlen for rows of this many tokens or more (the trainer's token_budget), flex below: on an H100,
# Qwen3-0.6B's G=8 rows ran 15 % faster with flex at 4,096, 16 % faster with varlen at 8,192 (bench/LOG.md, issue 37)
VARLEN_FROM_TOKENS = 8192
FLASH_DTYPES = (torch.bfloat16, torch.float16)  # what FlashAttention (the varlen backend) computes in


@dataclass
class TreeAttentionPlan:
    """What the attention kernels need to know about one packed row, built once per forward.

    Attributes:
        backend: "sdpa", "flex" or "varlen".
        num_tokens: T.
        dense_mask: sdpa: [T, T] bool, True where the query may attend to the key.
        block_mask: flex: the FlexAttention ``BlockMask``.
        kv_index: varlen: [sum of path lengths] row index of each gathered key/value.
        kv_order, kv_offsets: varlen: the path positions sorted by row, and each row's range in that order
            (``path_gather.py``: the backward sums a row's copies without atomics).
        cu_seq_q, cu_seq_k: varlen: [S + 1] int32 offsets of each segment's queries / keys.
        max_q, max_k: varlen: longest segment / longest path.
        linear: the trie layout for Gated DeltaNet layers (``linear_attention.py``); None for attention-only models.
    """

    backend: str
    num_tokens: int
    dense_mask: torch.Tensor | None = None
    block_mask: Any = None
    kv_index: torch.Tensor | None = None
    kv_order: torch.Tensor | None = None
    kv_offsets: torch.Tensor | None = None
    cu_seq_q: torch.Tensor | None = None
    cu_seq_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0
    linear: LinearTreePlan | None = None


def build_plan(
    row: PackedRow,
    backend: str = "auto",
    device: torch.device | str | None = None,
    linear_attention: bool = False,
    linear_chunk: int = DEFAULT_CHUNK,
) -> TreeAttentionPlan:
    """Prepare the attention structure of ``row`` for ``backend`` on ``device``.

    Args:
        row: the packed row (its tensors may live on any device).
        backend: "auto" (flex on CUDA with Triton, sdpa elsewhere: the row alone does not settle the run's
            kernel, ``resolve_backend`` with the run's token budget does), "sdpa", "flex" or "varlen".
        device: where the model runs; defaults to the row's device.
        linear_attention: also lay the row out for Gated DeltaNet layers (``packed_hidden_states`` does this
            by itself for models that have them).
        linear_chunk: tokens per chunk of the delta rule.

    Raises:
        ValueError: for an unknown backend, a CUDA-only backend on another device, or flex without Triton.
    """
    device = torch.device(device) if device is not None else row.input_ids.device
    backend = resolve_backend(backend, device)
    total = row.num_tokens
    end = row.subtree_end.to(device)
    if backend == "sdpa":
        plan = TreeAttentionPlan("sdpa", total, dense_mask=dense_tree_mask(end))
    elif backend == "flex":
        plan = TreeAttentionPlan("flex", total, block_mask=flex_block_mask(end))
    else:
        plan = _varlen_plan(row, device)
    if linear_attention:
        plan.linear = build_linear_plan(row, device, linear_chunk)
    return plan


def resolve_backend(
    backend: str, device: torch.device | str, row_tokens: int | None = None, dtype: torch.dtype | None = None
) -> str:
    """The backend ``build_plan`` runs for ``backend`` on ``device``; ValueError, saying what to choose, for an
    unknown one or one the device cannot run.

    "auto" is made concrete here: sdpa off CUDA; on CUDA varlen when rows may hold ``row_tokens`` >=
    ``VARLEN_FROM_TOKENS`` tokens and FlashAttention runs (``dtype`` bf16/fp16 or None, compute capability 8+),
    else flex (varlen, or sdpa, without Triton). One choice per run, not per row: compiled layers and CUDA
    graphs then trace one kernel.
    """
    device = torch.device(device)
    if backend not in BACKENDS:
        raise ValueError(f"tree attention backend {backend!r} is unknown; choose one of {BACKENDS}")
    if backend == "auto":
        backend = _auto_backend(device, row_tokens, dtype)
    if backend in ("flex", "varlen") and device.type != "cuda":
        raise ValueError(f"tree attention backend {backend!r} needs a CUDA device, got {device}; use 'sdpa' or 'auto'")
    if backend == "flex" and not have_triton():
        raise ValueError(f"tree attention backend 'flex' needs Triton on CUDA: {INSTALL_HINT}; or use 'varlen'")
    return backend


def _auto_backend(device: torch.device, row_tokens: int | None, dtype: torch.dtype | None) -> str:
    if device.type != "cuda":
        return "sdpa"
    varlen = varlen_runs(device, dtype)
    if varlen and row_tokens is not None and row_tokens >= VARLEN_FROM_TOKENS:
        return "varlen"
    if have_triton():
        return "flex"
    warn_missing("tree attention (FlexAttention)")  # FlexAttention is compiled by Triton on CUDA
    return "varlen" if varlen else "sdpa"


def varlen_runs(device: torch.device | str, dtype: torch.dtype | None = None) -> bool:
    """Whether the varlen backend can run on ``device`` in ``dtype`` (None: not known yet, taken as yes):
    FlashAttention inside torch needs bf16/fp16 and an Ampere-or-newer GPU."""
    if dtype is not None and dtype not in FLASH_DTYPES:
        return False
    try:
        _load_varlen()
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability(torch.device(device))[0] >= 8


def dense_tree_mask(end: torch.Tensor) -> torch.Tensor:
    """[T, T] bool: key k visible to query q iff k <= q < end[k] (causal, restricted to q's path)."""
    idx = torch.arange(end.numel(), device=end.device)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] < end[None, :])


def flex_block_mask(end: torch.Tensor) -> Any:
    """FlexAttention block mask of the tree, classified per 128x128 block without a [T, T] tensor.

    The number of visible (q, k) pairs in a block is the sum over its keys k of the length of
    ``[max(k, q_lo), min(end[k], q_hi))``; a block is full when that equals its area, empty at 0.
    """
    from torch.nn.attention.flex_attention import BlockMask

    total, dev = end.numel(), end.device
    nb = max(1, -(-total // FLEX_BLOCK))
    lo = torch.arange(nb, device=dev) * FLEX_BLOCK
    hi = torch.clamp(lo + FLEX_BLOCK, max=total)
    keys = torch.arange(total, device=dev)
    pairs = (torch.minimum(end[None, :], hi[:, None]) - torch.maximum(keys[None, :], lo[:, None])).clamp_(min=0)
    pairs = F.pad(pairs.to(torch.int32), (0, nb * FLEX_BLOCK - total))  # [nb_q, nb_k * 128]
    counts = pairs.view(nb, nb, FLEX_BLOCK).sum(-1)  # [nb_q, nb_k]
    sizes = hi - lo
    area = sizes[:, None] * sizes[None, :]
    full = (counts == area) & (area > 0)
    partial = (counts > 0) & ~full

    def indices(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = sel.sum(-1, dtype=torch.int32)
        order = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # selected blocks first
        return num[None, None], order[None, None]

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)
    # keys past T (FlexAttention pads to whole blocks) get end 0, so no query sees them
    end_padded = F.pad(end, (0, nb * FLEX_BLOCK - total))

    def tree_mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return (kv <= q) & (q < end_padded[kv])

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=FLEX_BLOCK, mask_mod=tree_mask, seq_lengths=(total, total)
    )


def _varlen_plan(row: PackedRow, device: torch.device) -> TreeAttentionPlan:
    """One varlen sequence per segment: queries = its tokens, keys = its root-to-leaf path.

    The kernel's module is imported here, eager, before any layer runs the plan: inside a compiled layer the
    import would break tracing. Not earlier: importing it registers its custom ops, 1.2-1.8 s of a run's start
    that runs with FlexAttention never needs (bench/LOG.md, issue 41)."""
    try:
        _load_varlen()
    except ImportError as exc:
        raise ValueError(
            f"tree attention backend 'varlen' needs torch.nn.attention.varlen, which torch {torch.__version__} "
            "lacks; use backend='flex' or 'auto'"
        ) from exc
    starts, ends, parents = (t.cpu().numpy() for t in (row.seg_start, row.seg_end, row.seg_parent))
    paths: list[np.ndarray] = []
    for s in range(len(starts)):  # parents precede children in depth-first order
        own = np.arange(starts[s], ends[s], dtype=np.int64)
        paths.append(np.concatenate([paths[parents[s]], own]) if parents[s] >= 0 else own)
    q_len = ends - starts
    k_len = np.array([len(p) for p in paths], dtype=np.int64)
    to = {"device": device, "dtype": torch.int32}
    kv_index = np.concatenate(paths) if paths else np.zeros(0, dtype=np.int64)
    kv_order, kv_offsets = path_order(torch.from_numpy(kv_index), row.num_tokens)
    return TreeAttentionPlan(
        "varlen",
        row.num_tokens,
        kv_index=torch.from_numpy(kv_index).to(device),
        kv_order=kv_order.to(device),
        kv_offsets=kv_offsets.to(device),
        cu_seq_q=torch.tensor(np.concatenate([[0], np.cumsum(q_len)]), **to),
        cu_seq_k=torch.tensor(np.concatenate([[0], np.cumsum(k_len)]), **to),
        max_q=int(q_len.max(initial=0)),
        max_k=int(k_len.max(initial=0)),
    )


# ---------------------------------------------------------------------- kernels
_compiled_flex: Any = None


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: TreeAttentionPlan, scale: float | None):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    gqa = query.shape[1] != key.shape[1]
    if torch.compiler.is_compiling():  # inside a compiled decoder layer (trainer/compile.py): part of its graph
        return flex_attention(query, key, value, block_mask=plan.block_mask, scale=scale, enable_gqa=gqa)
    if _compiled_flex is None:  # compiled once per process; FlexAttention is only fast compiled
        # dynamic from the first call: a static graph for the first row length was recompiled for the second
        # (dynamic) and once more for a third on an H200, each 5-7 s inside a training step
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex(query, key, value, block_mask=plan.block_mask, scale=scale, enable_gqa=gqa)


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: TreeAttentionPlan, scale: float | None):
    varlen_attn = _load_varlen()
    device = query.device.type
    if query.dtype not in FLASH_DTYPES and torch.is_autocast_enabled(device):
        # fp32 weights under bf16 autocast: rotary embeddings promote q/k back to fp32; SDPA would be cast by autocast
        dtype = torch.get_autocast_dtype(device)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    if query.dtype not in FLASH_DTYPES:
        raise TypeError(
            f"tree attention backend 'varlen' runs FlashAttention, which needs bf16/fp16, not {query.dtype}: load "
            "the model in bf16, train under bf16 autocast (bf16=True), or use 'flex'"
        )
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    # K/V widened to the query heads: FlashAttention's own GQA reduction of dK/dV is slow (path_gather.py)
    repeat = q.shape[1] // key.shape[1]
    gather = (plan.kv_index, plan.kv_order, plan.kv_offsets, repeat)
    k = path_gather(key[0].transpose(0, 1), *gather)  # [sum paths, H, D]
    v = path_gather(value[0].transpose(0, 1), *gather)
    # window (-1, 0) = causal aligned to the bottom right: a segment's queries are the last keys of its path
    out = varlen_attn(q, k, v, plan.cu_seq_q, plan.cu_seq_k, plan.max_q, plan.max_k, scale=scale, window_size=(-1, 0))
    return out.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]


_VARLEN_ATTN: Any = None


def _load_varlen() -> Any:
    """``torch.nn.attention.varlen.varlen_attn``, imported once (ImportError on a torch without it)."""
    global _VARLEN_ATTN
    if _VARLEN_ATTN is None:
        from torch.nn.attention.varlen import varlen_attn

        _VARLEN_ATTN = varlen_attn
    return _VARLEN_ATTN


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    tree_plan: TreeAttentionPlan | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: q [1, H, T, D], k/v [1, H_kv, T, D] -> ([1, T, H, D], None)."""
    if tree_plan is None:  # an ordinary batch (generation, evaluation): plain SDPA with transformers' mask
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1 or query.shape[2] != tree_plan.num_tokens:
        raise ValueError(
            f"tree attention expects one packed row of {tree_plan.num_tokens} tokens, got query {tuple(query.shape)}"
        )
    if sliding_window is not None:
        raise ValueError("tree attention does not support sliding-window layers; disable use_sliding_window")
    if tree_plan.backend == "sdpa":
        mask = tree_plan.dense_mask[None, None]
        gqa = query.shape[1] != key.shape[1]
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa
        )
    elif dropout:
        raise ValueError(f"tree attention backend {tree_plan.backend!r} has no attention dropout; set it to 0")
    elif tree_plan.backend == "flex":
        out = _flex(query, key, value, tree_plan, scaling)
    else:
        out = _varlen(query, key, value, tree_plan, scaling)
    return out.transpose(1, 2).contiguous(), None


def _tree_mask_function(**kwargs: Any) -> torch.Tensor | None:
    """No mask for packed rows (the plan carries the structure); SDPA's mask for padded batches."""
    if kwargs.get("attention_mask") is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(**kwargs)


_REGISTERED = False


def register_tree_attention() -> str:
    """Register the attention and mask functions with transformers (idempotent); returns the name."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)
        AttentionMaskInterface.register(TREE_ATTENTION, _tree_mask_function)
        _REGISTERED = True
    return TREE_ATTENTION


def use_tree_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` (a transformers ``PreTrainedModel``) to tree attention; Gated DeltaNet layers follow the trie."""
    register_tree_attention()
    model.set_attn_implementation(TREE_ATTENTION)
    install_tree_linear_attention(model)


def packed_hidden_states(
    model: torch.nn.Module,
    row: PackedRow,
    plan: TreeAttentionPlan | None = None,
    router_logits: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Final hidden states [T, hidden] of ``row`` (the LM head is left to ``trainer.logprobs``).

    The model must use tree attention (:func:`use_tree_attention`); ``row`` must be on the
    model's device. Calls the decoder (``model.get_decoder()``, which also reaches through a PEFT
    wrapper) so no [T, vocab] logits are built. A mixture-of-experts decoder also reports its
    routers' logits when ``router_logits`` is a list: one [T, experts] tensor per MoE layer is appended.
    """
    if plan is None:
        plan = build_plan(row)
    if plan.linear is None and needs_linear_plan(model):
        plan.linear = build_linear_plan(row, row.input_ids.device)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    extra = {"output_router_logits": True} if router_logits is not None else {}
    out = decoder(
        input_ids=row.input_ids[None],
        position_ids=row.position_ids[None],
        attention_mask=None,
        use_cache=False,
        tree_plan=plan,
        **extra,
    )
    if router_logits is not None:
        got = getattr(out, "router_logits", None)
        if not got:
            raise ValueError(f"{type(decoder).__name__} reported no router logits; is it a mixture-of-experts model?")
        router_logits.extend(t.reshape(-1, t.shape[-1]) for t in got)
    return out.last_hidden_state[0]

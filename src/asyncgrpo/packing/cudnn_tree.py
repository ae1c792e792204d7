"""Tree attention on cuDNN's fused attention, in two calls merged by their log-sum-exp.

torch's FlashAttention 2 is not a Hopper kernel: on the 1.7B bench rows it runs at 200-280 TFLOP/s against the
GEMMs' ~790 (bench/LOG.md, issue 37). cuDNN's ragged attention (``aten::_cudnn_attention_forward`` with cumulative
sequence lengths) is, but torch aligns its causal mask to the top left of each sequence, and a tree segment's
queries are the *last* tokens of its path. So each query's keys are split in two:

- **own**: the segment's own tokens, causal. Queries and keys are the same tokens (top left = bottom right), read
  straight from the row: nothing is gathered.
- **ancestors**: the tokens of the segment's ancestors, all visible (no mask). Consecutive siblings share them,
  so one query sequence covers a run of siblings and a prompt shared by G completions is gathered once, not G
  times. A root segment has no ancestors. Its run gets its first token as a placeholder key (cuDNN's backward
  failed on sequences without keys: NaN gradients on small rows, an illegal memory access on a bench-sized one, on
  an H100 with torch 2.11); the merge drops that part for root tokens, and its backward gets a zero output gradient
  there, so the placeholder adds nothing anywhere.

The two partial softmaxes are merged by their log-sum-exp; the backward calls cuDNN's backward for each part with
the *merged* output and log-sum-exp, which gives each part its exact share of the gradient (as ring attention does).
A flat row (no shared prefixes) makes one causal call and no merge.

Both directions are custom ops, opaque to ``torch.compile``: the compiled decoder layers call them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncgrpo.packing.path_gather import path_gather, path_order
from asyncgrpo.packing.row import PackedRow

__all__ = ["CudnnTreePlan", "build_cudnn_plan", "cudnn_tree_attention"]


@dataclass
class CudnnTreePlan:
    """One row's layout for the two cuDNN calls (module docstring).

    Attributes:
        cu_own: [S + 1] int32 offsets of the segments (queries and keys of the causal part).
        max_own: the longest segment.
        cu_run_q, cu_run_k: [R + 1] int32 offsets of the runs of siblings / of their gathered ancestors' tokens;
            None for a row without shared prefixes (then only the own part runs).
        max_run_q, max_run_k: the longest run / ancestor path.
        ancestors_index, ancestors_order, ancestors_offsets: the gather of the ancestors' tokens (``path_gather``).
        has_ancestors: [T] bool, the tokens whose queries see ancestors (False for root segments, whose run has a
            placeholder key).
    """

    cu_own: torch.Tensor
    max_own: int
    cu_run_q: torch.Tensor | None = None
    cu_run_k: torch.Tensor | None = None
    max_run_q: int = 0
    max_run_k: int = 0
    ancestors_index: torch.Tensor | None = None
    ancestors_order: torch.Tensor | None = None
    ancestors_offsets: torch.Tensor | None = None
    has_ancestors: torch.Tensor | None = None


def build_cudnn_plan(row: PackedRow, device: torch.device) -> CudnnTreePlan:
    """Segments, runs of siblings and their ancestors' tokens, from the row's segment table (depth-first order)."""
    starts, ends, parents = (t.cpu().numpy().astype(np.int64) for t in (row.seg_start, row.seg_end, row.seg_parent))
    to = {"device": device, "dtype": torch.int32}
    q_len = ends - starts
    plan = CudnnTreePlan(
        cu_own=torch.tensor(np.concatenate([[0], np.cumsum(q_len)]), **to), max_own=int(q_len.max(initial=0))
    )
    if not (parents >= 0).any():
        return plan
    paths: list[np.ndarray] = []  # each segment's root-to-leaf tokens; parents precede children
    for s in range(len(starts)):
        own = np.arange(starts[s], ends[s], dtype=np.int64)
        paths.append(np.concatenate([paths[parents[s]], own]) if parents[s] >= 0 else own)
    run_q, run_k, gathered = [], [], []
    for s in range(len(starts)):
        if s > 0 and parents[s] == parents[s - 1] and ends[s - 1] == starts[s]:
            run_q[-1] += int(q_len[s])  # a sibling right after its sibling: same ancestors, same run
            continue
        ancestors = paths[parents[s]] if parents[s] >= 0 else np.array([starts[s]])  # a root: placeholder key
        run_q.append(int(q_len[s]))
        run_k.append(len(ancestors))
        gathered.append(ancestors)
    index = torch.from_numpy(np.concatenate(gathered))
    order, offsets = path_order(index, row.num_tokens)
    has = np.zeros(row.num_tokens, dtype=bool)
    for s in np.nonzero(parents >= 0)[0]:
        has[starts[s] : ends[s]] = True
    plan.cu_run_q = torch.tensor(np.concatenate([[0], np.cumsum(run_q)]), **to)
    plan.cu_run_k = torch.tensor(np.concatenate([[0], np.cumsum(run_k)]), **to)
    plan.max_run_q, plan.max_run_k = max(run_q), max(run_k)
    plan.ancestors_index, plan.ancestors_order, plan.ancestors_offsets = (
        index.to(device),
        order.to(device),
        offsets.to(device),
    )
    plan.has_ancestors = torch.from_numpy(has).to(device)
    return plan


def cudnn_tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CudnnTreePlan, scale: float | None
) -> torch.Tensor:
    """q [T, H, D], k/v [T, H_kv, D] (bf16/fp16, CUDA) -> [T, H, D]; the row's tree attention (module docstring)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if plan.cu_run_q is None:
        kp = vp = None
    else:
        gather = (plan.ancestors_index, plan.ancestors_order, plan.ancestors_offsets, 1)
        kp, vp = path_gather(k, *gather), path_gather(v, *gather)
    runs = (plan.cu_run_q, plan.cu_run_k, plan.has_ancestors)
    return torch.ops.asyncgrpo.cudnn_tree_fwd(
        q, k, v, kp, vp, plan.cu_own, *runs, plan.max_own, plan.max_run_q, plan.max_run_k, scale
    )[0]


# ---------------------------------------------------------------------- the two cuDNN calls and their merge
def _cudnn_forward(*args, **kwargs):
    """``aten::_cudnn_attention_forward`` (a module function: the CPU tests put a reference in its place)."""
    return torch.ops.aten._cudnn_attention_forward(*_offsets(args, 4), **kwargs)


def _cudnn_backward(*args, **kwargs):
    """``aten::_cudnn_attention_backward``."""
    return torch.ops.aten._cudnn_attention_backward(*_offsets(args, 9), **kwargs)


def _offsets(args: tuple, at: int) -> tuple:
    """The cumulative lengths at ``args[at:at + 2]`` as int64 where this torch build wants them so (nested tensors
    carry int64 offsets; the plan builds int32 ones, which FlashAttention needs)."""
    if not _INT64_OFFSETS[0]:
        return args
    return (*args[:at], args[at].long(), args[at + 1].long(), *args[at + 2 :])


_INT64_OFFSETS = [False]


def _attend(q, k, v, cu_q, cu_k, max_q, max_k, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One ragged cuDNN call: (out [T, H, D], lse [H, T] fp32)."""
    try:
        res = _cudnn_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False, scale=scale)
    except RuntimeError as exc:
        if _INT64_OFFSETS[0] or "Int" not in str(exc) and "Long" not in str(exc):
            raise
        _INT64_OFFSETS[0] = True  # once: this build takes int64 offsets
        res = _cudnn_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False, scale=scale)
    tokens, heads = q.shape[0], q.shape[1]
    lse = res[1]
    if lse.dim() == 2 and lse.shape[0] == heads and lse.shape[1] == tokens:
        _LSE_LAYOUT[0] = "ht"
        return res[0], lse
    _LSE_LAYOUT[0] = "th1" if lse.dim() == 3 else "th"  # token-major: [T, H, 1] or [T, H]
    return res[0], lse.reshape(tokens, heads).t()


def _lse_for_backward(lse_ht: torch.Tensor) -> torch.Tensor:
    """The merged [H, T] log-sum-exp in the layout this torch build's forward returned ([H, T], or [T, H, 1])."""
    if _LSE_LAYOUT[0] == "ht":
        return lse_ht.contiguous()
    lse = lse_ht.t().contiguous()
    return lse.unsqueeze(-1) if _LSE_LAYOUT[0] == "th1" else lse


_LSE_LAYOUT = ["ht"]  # torch builds differ; the first forward says which this one uses


def _merge(o_own, lse_own, o_anc, lse_anc, has):
    """Two partial attentions -> the whole one; root tokens (no ancestors) keep their own part."""
    lse_anc = torch.where(has[None, :], lse_anc, float("-inf"))
    lse = torch.logaddexp(lse_own, lse_anc)
    w_own = torch.exp(lse_own - lse).t().unsqueeze(-1)
    w_anc = torch.exp(lse_anc - lse).t().unsqueeze(-1)
    acc = torch.promote_types(o_own.dtype, torch.float32)
    o_anc = torch.where(has[:, None, None], o_anc.to(acc), 0.0)
    return (o_own.to(acc) * w_own + o_anc * w_anc).to(o_own.dtype), lse


_compiled_merge: Any = None


def _merged(o_own, lse_own, o_anc, lse_anc, has):
    global _compiled_merge
    from asyncgrpo.triton_support import have_triton

    if not (o_own.is_cuda and have_triton()):
        return _merge(o_own, lse_own, o_anc, lse_anc, has)
    if _compiled_merge is None:  # one fused kernel instead of ~10 eager passes over [T, H, D]
        _compiled_merge = torch.compile(_merge, dynamic=True)
    return _compiled_merge(o_own, lse_own, o_anc, lse_anc, has)


@torch.library.custom_op("asyncgrpo::cudnn_tree_fwd", mutates_args=())
def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kp: torch.Tensor | None,
    vp: torch.Tensor | None,
    cu_own: torch.Tensor,
    cu_run_q: torch.Tensor | None,
    cu_run_k: torch.Tensor | None,
    has: torch.Tensor | None,
    max_own: int,
    max_run_q: int,
    max_run_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _attend(q, k, v, cu_own, cu_own, max_own, max_own, True, scale)
    if kp is not None:
        o_anc, lse_anc = _attend(q, kp, vp, cu_run_q, cu_run_k, max_run_q, max_run_k, False, scale)
        out, lse = _merged(out, lse, o_anc, lse_anc, has)
    return out, lse.contiguous()


@_fwd.register_fake
def _fwd_fake(q, k, v, kp, vp, cu_own, cu_run_q, cu_run_k, has, max_own, max_run_q, max_run_k, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("asyncgrpo::cudnn_tree_bwd", mutates_args=())
def _bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kp: torch.Tensor | None,
    vp: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_own: torch.Tensor,
    cu_run_q: torch.Tensor | None,
    cu_run_k: torch.Tensor | None,
    has: torch.Tensor | None,
    max_own: int,
    max_run_q: int,
    max_run_k: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dout = dout.contiguous()
    lse_k = _lse_for_backward(lse)
    seed = offset = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: never read
    dq, dk, dv = _cudnn_backward(
        dout, q, k, v, out, lse_k, seed, offset, None, cu_own, cu_own, max_own, max_own, 0.0, True, scale=scale
    )
    if kp is None:
        return dq, dk, dv, q.new_empty(0), q.new_empty(0)
    dout = torch.where(has[:, None, None], dout, 0)  # root tokens: their placeholder key gets no gradient
    dq_a, dkp, dvp = _cudnn_backward(
        dout, q, kp, vp, out, lse_k, seed, offset, None, cu_run_q, cu_run_k, max_run_q, max_run_k, 0.0, False,
        scale=scale,
    )  # fmt: skip
    dq = dq + dq_a
    return dq, dk, dv, dkp, dvp


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, kp, vp, out, lse, cu_own, cu_run_q, cu_run_k, has, max_own, max_run_q, max_run_k, scale):
    dkp = torch.empty_like(kp) if kp is not None else q.new_empty(0)
    dvp = torch.empty_like(vp) if vp is not None else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dkp, dvp


def _setup(ctx, inputs, output) -> None:
    q, k, v, kp, vp, cu_own, cu_run_q, cu_run_k, has, max_own, max_run_q, max_run_k, scale = inputs
    ctx.save_for_backward(q, k, v, kp, vp, output[0], output[1], cu_own, cu_run_q, cu_run_k, has)
    ctx.sizes = (max_own, max_run_q, max_run_k, scale)


def _backward(ctx, dout, dlse):
    q, k, v, kp, vp, out, lse, cu_own, cu_run_q, cu_run_k, has = ctx.saved_tensors
    dq, dk, dv, dkp, dvp = torch.ops.asyncgrpo.cudnn_tree_bwd(
        dout, q, k, v, kp, vp, out, lse, cu_own, cu_run_q, cu_run_k, has, *ctx.sizes
    )
    anc = (dkp, dvp) if kp is not None else (None, None)
    return dq, dk, dv, *anc, None, None, None, None, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup)

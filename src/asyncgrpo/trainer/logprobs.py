"""Log-probs, entropy and top-N of trained tokens from hidden states, without a [tokens x vocab] fp32 tensor.

The LM head is applied chunk by chunk over tokens inside a custom autograd Function:
forward keeps only per-token statistics (log-sum-exp, expected logit) and backward
recomputes each chunk's logits, so peak memory is O(chunk x vocab) whatever the
number of tokens. Per token n with logits z = h W^T / temperature over the set S_n
(the full vocabulary, or the token's candidate set under top-k/top-p sampling):

    logp(v) = z_v - lse,   lse = log sum_{u in S} exp z_u,   H = lse - sum_{u in S} p_u z_u

and the gradient with respect to z of sum_n [g_n logp(target) + sum_k g_nk logp(extra_k) + g'_n H] is

    g onehot(target) + sum_k g_k onehot(extra_k) - p (g + sum_k g_k) - g' p (z - E_p[z]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

CHUNK_BYTES = 1 << 29  # default chunk: about 512 MB of fp32 logits (a few such buffers live at once)


@dataclass
class TokenLogprobs:
    """Per-token results of :func:`selective_logprobs` (fp32).

    Attributes:
        logprobs: [N] log-prob of each target (differentiable).
        extra_logprobs: [N, K] log-probs of ``extra_ids`` (differentiable), -inf where the id is -1.
        entropy: [N] entropy of the (renormalised) predictive distribution (differentiable).
        top_ids: [N, top_n] the model's own most likely tokens (no gradient).
        top_logprobs: [N, top_n] their log-probs (no gradient).
    """

    logprobs: torch.Tensor
    extra_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


def selective_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    extra_ids: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    want_entropy: bool = False,
    top_n: int = 0,
) -> TokenLogprobs:
    """Log-probs of ``targets`` under ``softmax(hidden @ weight.T / temperature)``, chunked over tokens.

    Args:
        hidden: [N, H] final hidden states at the predicting positions.
        weight: [V, H] LM head (output embedding) weight; a bias-free head is assumed.
        targets: [N] token ids whose log-probs are wanted.
        temperature: divides the logits (the sampler's temperature, so ratios compare like with like).
        chunk_size: tokens per chunk; default keeps a chunk's fp32 logits near 512 MB.
        extra_ids: [N, K] more ids per token (the sampler's top-N for score centering); -1 pads.
        candidates: [C, 2] (token index, vocab id) pairs: renormalise token n over its candidate set;
            tokens without a pair keep the full vocabulary. Targets must lie in their set.
        want_entropy: also return the entropy of each token's predictive distribution.
        top_n: also return the model's own ``top_n`` most likely tokens (no gradient).

    Returns:
        :class:`TokenLogprobs`.

    Raises:
        ValueError: on mismatched shapes or a non-positive temperature.
    """
    h = prepare_head_inputs(hidden, weight, targets, extra_ids, candidates, temperature, chunk_size)
    lp, extra_lp, ent, top_ids, top_lp = _ChunkedLogprobs.apply(
        hidden, weight, targets, h.extra, h.cand_rows, h.cand_cols, temperature, h.chunk_size, want_entropy, top_n,
        h.compute_dtype,
    )  # fmt: skip
    return token_logprobs(lp, extra_lp, ent, top_ids, top_lp, extra_ids is not None, want_entropy, top_n)


@dataclass(frozen=True)
class HeadInputs:
    """The LM-head arguments resolved once, shared by :func:`selective_logprobs` and the fused head loss."""

    chunk_size: int
    compute_dtype: torch.dtype
    extra: torch.Tensor  # [N, K] (K = 0 without extra ids)
    cand_rows: torch.Tensor  # candidate pairs sorted by token index (empty without candidate sets)
    cand_cols: torch.Tensor


def prepare_head_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    extra_ids: torch.Tensor | None,
    candidates: torch.Tensor | None,
    temperature: float,
    chunk_size: int | None,
) -> HeadInputs:
    """Check the shapes and temperature, and resolve the chunk size, compute dtype and candidate order.

    Raises:
        ValueError: on mismatched shapes or a non-positive temperature.
    """
    n_tok, vocab = hidden.shape[0], weight.shape[0]
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and weight {tuple(weight.shape)} [V, H]")
    if targets.shape != (n_tok,):
        raise ValueError(f"targets {tuple(targets.shape)} must be [N={n_tok}]")
    if extra_ids is not None and (extra_ids.dim() != 2 or extra_ids.shape[0] != n_tok):
        raise ValueError(f"extra_ids {tuple(extra_ids.shape)} must be [N={n_tok}, K]")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is None:
        chunk_size = max(16, CHUNK_BYTES // (4 * vocab))
    dev = hidden.device
    if torch.is_autocast_enabled(dev.type):  # follow autocast, as the model's own LM head would
        compute_dtype = torch.get_autocast_dtype(dev.type)
    else:
        compute_dtype = weight.dtype
    extra = extra_ids if extra_ids is not None else torch.zeros(n_tok, 0, dtype=torch.long, device=dev)
    if candidates is not None and candidates.numel():
        order = torch.argsort(candidates[:, 0], stable=True)
        cand_rows, cand_cols = candidates[order, 0].contiguous(), candidates[order, 1].contiguous()
    else:
        cand_rows = cand_cols = torch.zeros(0, dtype=torch.long, device=dev)
    return HeadInputs(chunk_size, compute_dtype, extra, cand_rows, cand_cols)


def token_logprobs(
    lp: torch.Tensor,
    extra_lp: torch.Tensor,
    ent: torch.Tensor,
    top_ids: torch.Tensor,
    top_lp: torch.Tensor,
    has_extra: bool,
    want_entropy: bool,
    top_n: int,
) -> TokenLogprobs:
    """The per-token results, with the parts that were not asked for as None."""
    return TokenLogprobs(
        logprobs=lp,
        extra_logprobs=extra_lp if has_extra else None,
        entropy=ent if want_entropy else None,
        top_ids=top_ids if top_n else None,
        top_logprobs=top_lp if top_n else None,
    )


class _Chunk:
    """Logits of tokens [lo, hi) restricted to their candidate sets; shared by forward and backward."""

    def __init__(self, ctx_like: Any, hidden: torch.Tensor, w: torch.Tensor, lo: int, hi: int) -> None:
        c = ctx_like
        self.h = hidden[lo:hi].to(w.dtype)
        self.z = (self.h @ w.T).float()  # [c, V] fp32
        if c.temperature != 1.0:
            self.z = self.z / c.temperature
        self.zm = self.z
        if c.cand_rows.numel():  # host sync: locate this chunk's candidate pairs
            a, b = torch.searchsorted(c.cand_rows, torch.tensor([lo, hi], device=c.cand_rows.device)).tolist()
            if b > a:
                rows, cols = c.cand_rows[a:b] - lo, c.cand_cols[a:b]
                allowed = torch.zeros_like(self.z, dtype=torch.bool)
                allowed[rows, cols] = True
                restricted = torch.zeros(hi - lo, dtype=torch.bool, device=self.z.device)
                restricted[rows] = True
                allowed |= ~restricted[:, None]  # tokens without a set keep the full vocabulary
                self.zm = self.z.masked_fill(~allowed, float("-inf"))


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, extra, cand_rows, cand_cols, temperature, chunk, want_entropy, top_n,
                compute_dtype):  # fmt: skip
        ctx.temperature, ctx.chunk, ctx.compute_dtype = temperature, chunk, compute_dtype
        ctx.cand_rows, ctx.cand_cols = cand_rows, cand_cols
        n_tok, dev = hidden.shape[0], hidden.device
        lp = torch.empty(n_tok, dtype=torch.float32, device=dev)
        lse = torch.empty(n_tok, dtype=torch.float32, device=dev)
        extra_lp = torch.empty(extra.shape, dtype=torch.float32, device=dev)
        ez = torch.empty(n_tok if want_entropy else 0, dtype=torch.float32, device=dev)
        ent = torch.empty_like(ez)
        top_ids = torch.empty(n_tok, top_n, dtype=torch.long, device=dev)
        top_lp = torch.empty(n_tok, top_n, dtype=torch.float32, device=dev)
        with torch.autocast(dev.type, enabled=False):
            w = weight.to(compute_dtype)  # a copy only under autocast with a higher-precision head
            for lo in range(0, n_tok, chunk):
                hi = min(lo + chunk, n_tok)
                ch = _Chunk(ctx, hidden, w, lo, hi)
                s = torch.logsumexp(ch.zm, dim=-1)  # [c]
                lse[lo:hi] = s
                lp[lo:hi] = ch.zm.gather(1, targets[lo:hi, None])[:, 0] - s
                if extra.shape[1]:
                    ids = extra[lo:hi]
                    got = ch.zm.gather(1, ids.clamp(min=0)) - s[:, None]
                    extra_lp[lo:hi] = got.masked_fill(ids < 0, float("-inf"))
                if want_entropy:
                    p = (ch.zm - s[:, None]).exp_()  # 0 outside the candidate set
                    ez[lo:hi] = (p[:, None, :] @ ch.z[:, :, None]).view(-1)  # sum_v p_v z_v without a [c, V] temp
                    ent[lo:hi] = s - ez[lo:hi]
                if top_n:
                    vals, idx = torch.topk(ch.zm, top_n, dim=-1)
                    top_ids[lo:hi], top_lp[lo:hi] = idx, vals - s[:, None]
        ctx.save_for_backward(hidden, weight, targets, extra, lse, ez)
        ctx.mark_non_differentiable(top_ids, top_lp)
        ctx.set_materialize_grads(False)
        return lp, extra_lp, ent, top_ids, top_lp

    @staticmethod
    def backward(ctx, g_lp, g_extra, g_ent, _g_ids, _g_top):
        hidden, weight, targets, extra, lse, ez = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_h or need_w) or (g_lp is None and g_extra is None and g_ent is None):
            return (None,) * 11
        n_tok = hidden.shape[0]
        d_hidden = torch.empty_like(hidden) if need_h else None
        # accumulate the weight gradient in fp32 across chunks when the weight is low precision
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(ctx.compute_dtype)
            for lo in range(0, n_tok, ctx.chunk):
                hi = min(lo + ctx.chunk, n_tok)
                ch = _Chunk(ctx, hidden, w, lo, hi)
                p = (ch.zm - lse[lo:hi, None]).exp_()  # [c, V], 0 outside candidate sets
                coef = torch.zeros(hi - lo, dtype=torch.float32, device=p.device)
                if g_lp is not None:
                    coef += g_lp[lo:hi]
                ids = extra[lo:hi]
                ge = None
                if g_extra is not None and extra.shape[1]:
                    ge = g_extra[lo:hi].float().masked_fill(ids < 0, 0.0)
                    coef += ge.sum(-1)
                if g_ent is not None and ez.numel():  # -p (coef + g' (z - E[z])), in place to spare [c, V] buffers
                    factor = ch.z.sub_(ez[lo:hi, None]).mul_(g_ent[lo:hi, None].float()).add_(coef[:, None])
                    dz = p.mul_(factor).neg_()
                else:
                    dz = p.mul_(-coef[:, None])
                if g_lp is not None:
                    dz.scatter_add_(1, targets[lo:hi, None], g_lp[lo:hi, None].float())
                if ge is not None:
                    dz.scatter_add_(1, ids.clamp(min=0), ge)
                if ctx.temperature != 1.0:
                    dz /= ctx.temperature
                dz = dz.to(w.dtype)
                if need_h:
                    d_hidden[lo:hi] = (dz @ w).to(hidden.dtype)
                if need_w:
                    d_weight += dz.T @ ch.h  # in-place add promotes the bf16 partial without an fp32 copy
        if need_w:
            d_weight = d_weight.to(weight.dtype)
        return (d_hidden, d_weight) + (None,) * 9

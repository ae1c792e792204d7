"""LM head + per-token loss in one chunked pass: the gradient is formed in the forward, so no logits are recomputed.

:func:`~asyncgrpo.trainer.logprobs.selective_logprobs` keeps only per-token statistics in its forward and
recomputes every chunk's logits in the backward: two LM-head matmuls of the forward size plus two for the
gradients, 8 N V H FLOPs. Here the loss is known chunk by chunk (the policy loss of a token depends only on
that token's log-probs), so while a chunk's logits are live its loss gradient g = dL/dlogp is taken by autograd
on the [c] / [c, K] log-prob tensors, the logit gradient is formed as in ``logprobs.py``

    dz = g onehot(target) + sum_k g_k onehot(extra_k) - p (g + sum_k g_k)      (divided by the temperature)

and ``dz @ W`` (hidden) and ``dz^T h`` (head weight, accumulated in fp32) are stored: 6 N V H FLOPs, one pass
over each chunk's [c, V] logits, nothing of size V kept per token. The backward only scales the stored
gradients by the incoming scalar gradient.

The fp32 weight-gradient accumulator is as large as the head (1.2 GB at a 152k x 2048 head) and every chunk
adds to it, so on CUDA the add happens inside the chunk's GEMM (fp32 output, beta = 1) where this torch allows
it: a separate add re-read and re-wrote the accumulator 31 times a step, 6 % of a 1.7B model's step on an H100
(bench/LOG.md, issue 37). Without candidate sets the logits stay in the compute dtype, so a chunk holds twice
the tokens of ``logprobs.py``'s fp32 chunk for the same bytes: half as many passes over the accumulator.

Entropy and the model's own top tokens are returned without gradient (the policy loss uses entropy as a metric).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncgrpo.trainer import head_kernels
from asyncgrpo.trainer.logprobs import CHUNK_BYTES, TokenLogprobs, _Chunk, prepare_head_inputs, token_logprobs

# chunk_loss(lo, hi, logprobs[c], extra_logprobs[c, K] or None) -> 0-d loss of tokens [lo, hi)
ChunkLoss = Callable[[int, int, torch.Tensor, torch.Tensor | None], torch.Tensor]

__all__ = ["ChunkLoss", "add_weight_grad", "fused_logprobs_loss", "weight_grad_in_gemm"]


def fused_logprobs_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_loss: ChunkLoss,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    extra_ids: torch.Tensor | None = None,
    candidates: torch.Tensor | None = None,
    want_entropy: bool = False,
    top_n: int = 0,
) -> tuple[torch.Tensor, TokenLogprobs]:
    """Loss = sum over chunks of ``chunk_loss`` of the chunk's log-probs, differentiable w.r.t. hidden and weight.

    Args:
        hidden, weight, targets, temperature, chunk_size, extra_ids, candidates, want_entropy, top_n: as in
            :func:`~asyncgrpo.trainer.logprobs.selective_logprobs`.
        chunk_loss: ``(lo, hi, logprobs, extra_logprobs) -> 0-d tensor``, the loss of tokens ``[lo, hi)``; it
            must depend on those tokens' log-probs only (per-token losses summed, divided by a constant).

    Returns:
        ``(loss, TokenLogprobs)``: the fp32 0-d loss (its backward gives hidden and weight their gradients) and
        the per-token results, all detached.

    Raises:
        ValueError: on mismatched shapes or a non-positive temperature.
    """
    h = prepare_head_inputs(hidden, weight, targets, extra_ids, candidates, temperature, chunk_size)
    chunk = h.chunk_size
    if chunk_size is None and not h.cand_rows.numel():  # logits in the compute dtype: as many bytes, more tokens
        chunk = max(16, CHUNK_BYTES // (h.compute_dtype.itemsize * weight.shape[0]))
    opts = _Opts(temperature, chunk, h.compute_dtype, h.cand_rows, h.cand_cols, want_entropy, top_n,
                 chunk_loss, extra_ids is not None, torch.is_grad_enabled())  # fmt: skip
    loss, lp, extra_lp, ent, top_ids, top_lp = _FusedHeadLoss.apply(hidden, weight, targets, h.extra, opts)
    return loss, token_logprobs(lp, extra_lp, ent, top_ids, top_lp, extra_ids is not None, want_entropy, top_n)


class _Opts:
    """Non-tensor arguments of the Function (also read by ``_Chunk`` as its ``ctx_like``)."""

    def __init__(self, temperature, chunk, compute_dtype, cand_rows, cand_cols, want_entropy, top_n, chunk_loss,
                 has_extra, grad_enabled) -> None:  # fmt: skip
        self.temperature, self.chunk, self.compute_dtype = temperature, chunk, compute_dtype
        self.cand_rows, self.cand_cols = cand_rows, cand_cols
        self.want_entropy, self.top_n, self.chunk_loss = want_entropy, top_n, chunk_loss
        self.has_extra, self.grad_enabled = has_extra, grad_enabled


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, extra, o: _Opts):
        n_tok, dev = hidden.shape[0], hidden.device
        need_h = o.grad_enabled and ctx.needs_input_grad[0]
        need_w = o.grad_enabled and ctx.needs_input_grad[1]
        lp = torch.empty(n_tok, dtype=torch.float32, device=dev)
        extra_lp = torch.empty(extra.shape, dtype=torch.float32, device=dev)
        ent = torch.empty(n_tok if o.want_entropy else 0, dtype=torch.float32, device=dev)
        top_ids = torch.empty(n_tok, o.top_n, dtype=torch.long, device=dev)
        top_lp = torch.empty(n_tok, o.top_n, dtype=torch.float32, device=dev)
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=dev)
        with torch.autocast(dev.type, enabled=False):
            w = weight.to(o.compute_dtype)
            for lo in range(0, n_tok, o.chunk):
                hi = min(lo + o.chunk, n_tok)
                if not o.cand_rows.numel():  # no candidate sets: the fused elementwise path
                    total += _plain_chunk(o, hidden, w, targets, extra, lo, hi, need_h, need_w,
                                          (lp, extra_lp, ent, top_ids, top_lp, d_hidden, d_weight))  # fmt: skip
                    continue
                ch = _Chunk(o, hidden, w, lo, hi)
                s = torch.logsumexp(ch.zm, dim=-1)
                lp[lo:hi] = ch.zm.gather(1, targets[lo:hi, None])[:, 0] - s
                ids = extra[lo:hi]
                if extra.shape[1]:
                    got = ch.zm.gather(1, ids.clamp(min=0)) - s[:, None]
                    extra_lp[lo:hi] = got.masked_fill(ids < 0, float("-inf"))
                p = None
                if o.want_entropy:
                    p = (ch.zm - s[:, None]).exp_()
                    ent[lo:hi] = s - (p[:, None, :] @ ch.z[:, :, None]).view(-1)
                if o.top_n:
                    vals, idx = torch.topk(ch.zm, o.top_n, dim=-1)
                    top_ids[lo:hi], top_lp[lo:hi] = idx, vals - s[:, None]
                g_lp, g_ex, chunk_total = _chunk_grads(o, lo, hi, lp[lo:hi], extra_lp[lo:hi], need_h or need_w)
                total += chunk_total
                if not (need_h or need_w):
                    continue
                if p is None:
                    p = (ch.zm - s[:, None]).exp_()  # 0 outside candidate sets
                coef = g_lp.clone()
                ge = None
                if g_ex is not None and extra.shape[1]:
                    ge = g_ex.masked_fill(ids < 0, 0.0)
                    coef += ge.sum(-1)
                dz = p.mul_(-coef[:, None])
                dz.scatter_add_(1, targets[lo:hi, None], g_lp[:, None])
                if ge is not None:
                    dz.scatter_add_(1, ids.clamp(min=0), ge)
                if o.temperature != 1.0:
                    dz /= o.temperature
                dz = dz.to(w.dtype)
                if need_h:
                    d_hidden[lo:hi] = (dz @ w).to(hidden.dtype)
                if need_w:
                    add_weight_grad(d_weight, dz, ch.h)
        ctx.save_for_backward(d_hidden, d_weight.to(weight.dtype) if need_w else None)
        ctx.mark_non_differentiable(lp, extra_lp, ent, top_ids, top_lp)
        return total, lp, extra_lp, ent, top_ids, top_lp

    @staticmethod
    def backward(ctx, g_loss, *_unused):
        d_hidden, d_weight = ctx.saved_tensors
        if g_loss is None:
            return None, None, None, None, None
        scale = g_loss.to(torch.float32)
        dh = d_hidden * scale.to(d_hidden.dtype) if d_hidden is not None else None
        dw = d_weight * scale.to(d_weight.dtype) if d_weight is not None else None
        return dh, dw, None, None, None


def _plain_chunk(
    o: _Opts, hidden, w, targets, extra, lo: int, hi: int, need_h: bool, need_w: bool, outs
) -> torch.Tensor:
    """One chunk without candidate sets: logits stay in the matmul dtype; ``head_kernels`` do the dense work and
    the one-hot terms go straight into the hidden and weight gradients. Returns the chunk's loss."""
    lp, extra_lp, ent, top_ids, top_lp, d_hidden, d_weight = outs
    t_inv = 1.0 / o.temperature
    h = hidden[lo:hi].to(w.dtype)
    zb = h @ w.T  # [c, V] in the compute dtype
    s, mean_z = head_kernels.row_stats(zb, o.temperature, o.want_entropy)
    t = targets[lo:hi]
    lp[lo:hi] = zb.gather(1, t[:, None])[:, 0].float() / o.temperature - s
    ids = extra[lo:hi]
    safe_ids = ids.clamp(min=0)
    if extra.shape[1]:
        got = zb.gather(1, safe_ids).float() / o.temperature - s[:, None]
        extra_lp[lo:hi] = got.masked_fill(ids < 0, float("-inf"))
    if o.want_entropy:
        ent[lo:hi] = s - mean_z
    if o.top_n:
        vals, idx = torch.topk(zb, o.top_n, dim=-1)
        top_ids[lo:hi], top_lp[lo:hi] = idx, vals.float() / o.temperature - s[:, None]
    g_lp, g_ex, chunk_total = _chunk_grads(o, lo, hi, lp[lo:hi], extra_lp[lo:hi], need_h or need_w)
    if not (need_h or need_w):
        return chunk_total
    coef = g_lp.clone()
    ge = None
    if g_ex is not None and extra.shape[1]:
        ge = g_ex.masked_fill(ids < 0, 0.0)
        coef += ge.sum(-1)
    dz = head_kernels.dense_grad(zb, s, coef, o.temperature)  # -p coef / T, [c, V]
    del zb
    hf = h.float()
    if need_h:  # dense part, plus sum over one-hot terms g_k W[id_k] / T
        sparse = (g_lp * t_inv)[:, None] * w[t].float()
        if ge is not None:
            sparse += torch.einsum("ck,ckh->ch", ge * t_inv, w[safe_ids].float())
        d_hidden[lo:hi] = ((dz @ w).float() + sparse).to(d_hidden.dtype)
    if need_w:
        add_weight_grad(d_weight, dz, h)
        d_weight.index_add_(0, t, (g_lp * t_inv)[:, None] * hf)
        if ge is not None:
            rows = (ge * t_inv)[:, :, None] * hf[:, None, :]  # [c, K, H]: small next to [c, V]
            d_weight.index_add_(0, safe_ids.reshape(-1), rows.reshape(-1, hf.shape[1]))
    return chunk_total


def _chunk_grads(
    o: _Opts, lo: int, hi: int, lp: torch.Tensor, extra_lp: torch.Tensor, want_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The chunk's loss and its gradient w.r.t. the chunk's log-probs (autograd over [c] and [c, K] tensors)."""
    with torch.enable_grad():
        a = lp.detach().requires_grad_(want_grad)
        b = extra_lp.detach().requires_grad_(want_grad) if o.has_extra else None
        loss = o.chunk_loss(lo, hi, a, b)
        if loss.dim() != 0:
            raise ValueError(f"chunk_loss must return a 0-d tensor, got shape {tuple(loss.shape)}")
        if not want_grad:
            return a, None, loss.detach().float()
        inputs = [a] if b is None else [a, b]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    g_lp = grads[0] if grads[0] is not None else torch.zeros_like(a)
    g_ex = grads[1] if b is not None else None
    if b is not None and g_ex is None:
        g_ex = torch.zeros_like(b)
    return g_lp.float(), g_ex.float() if g_ex is not None else None, loss.detach().float()


def add_weight_grad(acc: torch.Tensor, dz: torch.Tensor, h: torch.Tensor) -> None:
    """``acc += dz.T @ h`` for an fp32 ``acc``: inside the GEMM where :func:`weight_grad_in_gemm` says so, else the
    product in ``dz``'s dtype and then the add (CPU, fp32 inputs, or a torch without fp32-output matmuls)."""
    if dz.dtype != acc.dtype and weight_grad_in_gemm(acc.device):
        torch.addmm(acc, dz.T, h, out_dtype=acc.dtype, out=acc)
    else:
        acc += dz.T @ h


_IN_GEMM: dict[torch.device, bool] = {}


def weight_grad_in_gemm(device: torch.device) -> bool:
    """Whether this torch accumulates a bf16 product into an fp32 tensor inside the GEMM on ``device``.

    torch's CUDA ``addmm(..., out_dtype=float32)`` took an fp32 ``self`` only from some 2.x release on (earlier ones
    want ``self`` in the inputs' dtype), so one small call with a known answer decides, once per device."""
    if device.type != "cuda":
        return False
    if device not in _IN_GEMM:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(48, 160, device=device, generator=g).to(torch.bfloat16)
        b = torch.randn(48, 96, device=device, generator=g).to(torch.bfloat16)
        acc = torch.randn(160, 96, device=device, generator=g)
        want = acc + a.float().T @ b.float()
        try:
            torch.addmm(acc, a.T, b, out_dtype=torch.float32, out=acc)
            _IN_GEMM[device] = bool(torch.allclose(acc, want, rtol=1e-4, atol=1e-3))
        except (RuntimeError, TypeError):  # an older torch: self must share the inputs' dtype, or no out_dtype
            _IN_GEMM[device] = False
    return _IN_GEMM[device]

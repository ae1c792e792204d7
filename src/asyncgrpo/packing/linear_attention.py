"""Gated DeltaNet layers on a packed trie: the short convolution and the chunked delta rule follow trie paths.

A linear-attention layer mixes tokens through two things that are not attention:

- a short causal depthwise convolution over the last K tokens, and
- a recurrent state updated token by token by the gated delta rule.

In a packed row the "last K tokens" and "the state so far" must be those of the token's own
path in the trie, not its row neighbours (a sibling branch sits right before a token in the
row). So the convolution gathers each token's K-1 trie ancestors through ``PackedRow.parent``,
and the delta rule runs chunk by chunk where each chunk starts from the final state of the
chunk before it *on its path*: the previous chunk of its segment, or the last chunk of its
parent segment (segments fork only after their last token, see ``row.pack_trie``). Chunks are
grouped into waves by their depth along the path (number of chunks before them), so one wave
is one batched step, and the number of sequential steps is the longest path in chunks.

Per chunk with initial state S (gated delta rule, log-decay g, write strength beta, all fp32):

    u = T^-1 (beta v) - T^-1 (beta exp(c) k) S          T = I + strictly_lower(beta_i k_i.k_j exp(c_i - c_j))
    o = exp(c) q S + lower(q_i.k_j exp(c_i - c_j)) u    S' = exp(c_last) S + (exp(c_last - c) k)^T u

where c is the cumulative log-decay inside the chunk. Padding tokens (segments are padded to
whole chunks) have g = beta = k = q = v = 0, so they change neither outputs nor the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from asyncgrpo.packing.row import PackedRow

DEFAULT_CHUNK = 64


@dataclass
class LinearTreePlan:
    """What the linear-attention layers need to know about one packed row.

    Attributes:
        parent: [T] row index of each token's predecessor on its path, -1 at roots.
        chunk: tokens per chunk of the delta rule.
        gather: [NC * chunk] row index of each padded chunk slot (T = padding), chunks sorted by wave.
        scatter: [T] padded slot of each row token.
        wave_bounds: chunk offsets of each wave (length waves + 1).
        prev: per wave w >= 1, [chunks in w] index of each chunk's predecessor within wave w - 1.
    """

    parent: torch.Tensor
    chunk: int
    gather: torch.Tensor
    scatter: torch.Tensor
    wave_bounds: list[int]
    prev: list[torch.Tensor | None]
    _ancestors: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.parent.numel())

    def ancestors(self, width: int) -> torch.Tensor:
        """[T, width] row index of the token itself (column 0) and its width-1 nearest trie ancestors; -1 = none."""
        if width not in self._ancestors:
            cols = [torch.arange(self.num_tokens, device=self.parent.device)]
            for _ in range(width - 1):
                up = cols[-1]
                cols.append(torch.where(up >= 0, self.parent[up.clamp(min=0)], up))
            self._ancestors[width] = torch.stack(cols, dim=1)
        return self._ancestors[width]


def build_linear_plan(
    row: PackedRow, device: torch.device | str | None = None, chunk: int = DEFAULT_CHUNK
) -> LinearTreePlan:
    """Chunk layout of ``row``'s segments for :func:`tree_gated_delta_rule` (host-side numpy, once per row).

    Raises:
        ValueError: for a chunk size below 1, or a row whose segments fork inside a parent segment.
    """
    if chunk < 1:
        raise ValueError(f"linear attention chunk size must be >= 1, got {chunk}")
    device = torch.device(device) if device is not None else row.input_ids.device
    starts, ends, parents = (t.cpu().numpy().astype(np.int64) for t in (row.seg_start, row.seg_end, row.seg_parent))
    total, n_seg = row.num_tokens, len(starts)
    forked = parents >= 0
    token_parent = row.parent.cpu().numpy()[starts[forked]]
    if not np.array_equal(token_parent, ends[parents[forked]] - 1):  # the state handed over is the parent's final one
        raise ValueError("a segment forks inside its parent segment; rows must come from packing.row.pack_trie")
    n_chunks = -(-(ends - starts) // chunk)
    chunk_off = np.concatenate([[0], np.cumsum(n_chunks)]).astype(np.int64)
    first_wave = np.zeros(n_seg, dtype=np.int64)
    for s in range(n_seg):  # parents precede children in depth-first order
        p = parents[s]
        if p >= 0:
            first_wave[s] = first_wave[p] + n_chunks[p]
    n_all = int(chunk_off[-1])
    seg_of = np.repeat(np.arange(n_seg), n_chunks)
    local = np.arange(n_all) - chunk_off[seg_of]
    wave = first_wave[seg_of] + local
    par = parents[seg_of]
    prev_global = np.where(local > 0, np.arange(n_all) - 1, np.where(par >= 0, chunk_off[par + 1] - 1, -1))
    order = np.argsort(wave, kind="stable")  # chunks of one wave are contiguous
    rank = np.empty(n_all, dtype=np.int64)
    rank[order] = np.arange(n_all)
    bounds = np.searchsorted(wave[order], np.arange(int(wave.max(initial=-1)) + 2)).tolist()
    prev: list[torch.Tensor | None] = [None]
    for w in range(1, len(bounds) - 1):
        ranks = rank[prev_global[order[bounds[w] : bounds[w + 1]]]] - bounds[w - 1]
        prev.append(torch.from_numpy(ranks).to(device))
    slot_token = starts[seg_of[order]][:, None] + local[order][:, None] * chunk + np.arange(chunk)[None, :]
    valid = slot_token < ends[seg_of[order]][:, None]
    gather = np.where(valid, slot_token, total).reshape(-1)
    scatter = np.empty(total, dtype=np.int64)
    scatter[gather[valid.reshape(-1)]] = np.flatnonzero(valid.reshape(-1))
    return LinearTreePlan(
        parent=row.parent.to(device),
        chunk=chunk,
        gather=torch.from_numpy(gather).to(device),
        scatter=torch.from_numpy(scatter).to(device),
        wave_bounds=bounds,
        prev=prev,
    )


def tree_causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: LinearTreePlan
) -> torch.Tensor:
    """Depthwise causal convolution along trie paths.

    Args:
        x: [T, C] inputs in row order.
        weight: [C, K] the ``nn.Conv1d`` weight (groups = C) without its middle axis; tap K-1 is the token itself.
        bias: [C] or None.
        plan: the row's :class:`LinearTreePlan`.

    Returns:
        [T, C] in the weight's dtype, before any activation.
    """
    width = weight.shape[1]
    anc = plan.ancestors(width)  # [T, K]: self, parent, grandparent, ...
    padded = torch.cat([x.to(weight.dtype), x.new_zeros(1, x.shape[1], dtype=weight.dtype)])
    taps = padded[torch.where(anc >= 0, anc, x.shape[0])]  # [T, K, C]; missing ancestors read zeros
    out = torch.einsum("tkc,ck->tc", taps, weight.flip(1))  # ancestor j meets tap K-1-j
    return out + bias if bias is not None else out


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def tree_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    plan: LinearTreePlan,
    qk_l2norm: bool = True,
) -> torch.Tensor:
    """The gated delta rule over a packed trie, each segment continuing its parent's state.

    Args:
        query, key: [T, H_k, D_k]; value: [T, H_v, D_v] (H_v a multiple of H_k: grouped value heads).
        g: [T, H_v] log decay (<= 0). beta: [T, H_v] write strength.
        plan: the row's :class:`LinearTreePlan`.
        qk_l2norm: L2-normalise queries and keys first (what the Qwen3.5/Qwen3-Next layers ask for).

    Returns:
        [T, H_v, D_v] fp32 outputs in row order.
    """
    h_v = value.shape[1]
    if key.shape[1] != h_v:
        query, key = (t.repeat_interleave(h_v // t.shape[1], dim=1) for t in (query, key))
    query, key, value, g, beta = (t.float() for t in (query, key, value, g, beta))
    if qk_l2norm:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5
    c = plan.chunk

    def chunked(t: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [NC, H, C, ...], padding slots zero
        padded = torch.cat([t, t.new_zeros((1, *t.shape[1:]))]).index_select(0, plan.gather)
        return padded.view(-1, c, *t.shape[1:]).transpose(1, 2)

    q, k, v, gc, bc = (chunked(t) for t in (query, key, value, g, beta))  # gc, bc: [NC, H, C]
    cum = gc.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [NC, H, C, C]
    k_beta = k * bc[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1) + torch.eye(c, device=q.device)
    u_base = torch.linalg.solve_triangular(system, v * bc[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [NC, H, 1, 1]

    outs: list[torch.Tensor] = []
    state: torch.Tensor | None = None
    bounds = plan.wave_bounds
    for wv in range(len(bounds) - 1):
        lo, hi = bounds[wv], bounds[wv + 1]
        if wv == 0:  # the first chunks of root segments start from a zero state
            u = u_base[lo:hi]
            o = intra[lo:hi] @ u
            state = k_dec[lo:hi].transpose(-1, -2) @ u
        else:
            s0 = state.index_select(0, plan.prev[wv])
            u = u_base[lo:hi] - w[lo:hi] @ s0
            o = q_dec[lo:hi] @ s0 + intra[lo:hi] @ u
            state = s0 * chunk_decay[lo:hi] + k_dec[lo:hi].transpose(-1, -2) @ u
        outs.append(o)
    out = torch.cat(outs).transpose(1, 2).reshape(-1, h_v, value.shape[-1])  # [NC * C, H, D_v]
    return out.index_select(0, plan.scatter)


def padded_length(plan: LinearTreePlan) -> int:
    """Slots the delta rule computes (tokens + chunk padding); for diagnostics."""
    return int(plan.gather.numel())


__all__ = [
    "DEFAULT_CHUNK",
    "LinearTreePlan",
    "build_linear_plan",
    "padded_length",
    "tree_causal_conv",
    "tree_gated_delta_rule",
]

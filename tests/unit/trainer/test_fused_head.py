"""The fused LM-head loss (trainer/fused_head.py via trainer/packed_loss.py) against full-logit autograd.

Reference: materialise all [N, V] logits, log_softmax over each token's candidate set, feed `policy_loss`, and
let autograd differentiate; the fused path must give the same loss, metrics and gradients for hidden and head.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncgrpo.trainer.loss import policy_loss
from asyncgrpo.trainer.packed_loss import PolicyLossSettings, packed_policy_loss

N, H, V, K = 37, 12, 50, 4


def _row(seed: int, score_centering: bool, with_candidates: bool) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, V, (N,), generator=g)
    cand = None
    if with_candidates:  # tokens 0..9 sample from top-k sets of 6 ids that contain their target
        pairs = []
        for n in range(10):
            ids = torch.randperm(V, generator=g)[:6]
            ids[0] = targets[n]
            pairs += [(n, int(i)) for i in ids.unique()]
        cand = torch.tensor(pairs)
    top_ids = torch.randint(0, V, (N, K), generator=g)
    top_lp = -torch.rand(N, K, generator=g) * 4
    top_ids[::5, -1] = -1  # padding slots
    top_lp[::5, -1] = float("-inf")
    return SimpleNamespace(
        target_ids=targets,
        old_logprobs=-torch.rand(N, generator=g) * 3 - 0.5,
        advantages=torch.randn(N, generator=g),
        sampler_topn_ids=top_ids if score_centering else None,
        sampler_topn_logprobs=top_lp if score_centering else None,
        candidates=cand,
        entry_sample=torch.arange(N) // 8,
    )


def _reference(h, w, row, normalizer, s: PolicyLossSettings):
    z = h @ w.T / s.temperature
    if row.candidates is not None:
        allowed = torch.ones(N, V, dtype=torch.bool)
        restricted = torch.zeros(N, dtype=torch.bool)
        restricted[row.candidates[:, 0]] = True
        allowed[restricted] = False
        allowed[row.candidates[:, 0], row.candidates[:, 1]] = True
        z = z.masked_fill(~allowed, float("-inf"))
    logp = z.log_softmax(-1)
    lp = logp.gather(1, row.target_ids[:, None])[:, 0]
    top = None
    if row.sampler_topn_ids is not None:
        ids = row.sampler_topn_ids
        top = logp.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, float("-inf"))
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, 0.0)).sum(-1)
    return policy_loss(
        lp, row.old_logprobs, row.advantages, torch.ones(N, dtype=torch.bool), normalizer,
        score_centering=top is not None, top_logprobs=top, sampler_top_logprobs=row.sampler_topn_logprobs,
        sample_index=row.entry_sample, entropy=ent, **s.knobs(),
    )  # fmt: skip


@pytest.mark.parametrize("score_centering", [True, False])
@pytest.mark.parametrize("with_candidates", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_loss_metrics_and_gradients_match_full_logits(score_centering, with_candidates, fused):
    torch.manual_seed(0)
    h0, w0 = torch.randn(N, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64) * 0.5
    row = _row(1, score_centering, with_candidates)
    s = PolicyLossSettings(temperature=0.7, clip_min=0.3, clip_max=3.0, epsilon_low=0.2, epsilon_high=0.28,
                           fused_lm_head=fused, chunk_size=5)  # fmt: skip
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = _reference(h, w, row, 23.0, s)
    ref.loss.backward()
    h2, w2 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    got = packed_policy_loss(h2, w2, row, 23.0, s)
    got.loss.backward()
    # the log-prob kernels keep per-token results in fp32 (whatever the input dtype): fp32 tolerances
    assert abs(got.loss.item() - ref.loss.item()) <= 1e-6  # per-token terms are O(1) / 23, summed in fp32
    assert (h2.grad - h.grad).abs().max() <= 1e-5 * h.grad.abs().max()
    assert (w2.grad - w.grad).abs().max() <= 1e-5 * w.grad.abs().max()
    assert h.grad.abs().max() > 0 and w.grad.abs().max() > 0
    assert got.metrics.keys() == ref.metrics.keys()
    for name, (value, weight) in got.metrics.items():
        rv, rw = ref.metrics[name]
        assert torch.allclose(value.double(), rv.double(), atol=1e-6, equal_nan=True), name
        assert float(weight) == float(rw), name


def test_fused_head_scales_by_upstream_gradient_and_skips_frozen_head():
    torch.manual_seed(2)
    row = _row(3, True, False)
    s = PolicyLossSettings(chunk_size=8)
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H)  # frozen head (LoRA): no head gradient is formed
    (3.0 * packed_policy_loss(h, w, row, 10.0, s).loss).backward()
    h_ref = h.detach().clone().requires_grad_()
    (3.0 * _reference(h_ref, w, row, 10.0, s).loss).backward()
    assert w.grad is None
    assert torch.allclose(h.grad, h_ref.grad, rtol=1e-4, atol=1e-6)


def test_fused_head_without_grad_returns_the_loss_value():
    row = _row(4, True, True)
    h, w = torch.randn(N, H), torch.randn(V, H)
    s = PolicyLossSettings(chunk_size=7)
    with torch.no_grad():
        got = packed_policy_loss(h, w, row, 5.0, s).loss
    ref = _reference(h, w, row, 5.0, s).loss
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_without_candidates_a_bf16_chunk_holds_twice_the_tokens_of_an_fp32_one(monkeypatch):
    """The plain path keeps logits in the compute dtype, so the default chunk is sized by its bytes, not fp32's."""
    from asyncgrpo.trainer import fused_head, logprobs

    monkeypatch.setattr(logprobs, "CHUNK_BYTES", 4 * V * 16)  # 16 tokens of fp32 logits
    monkeypatch.setattr(fused_head, "CHUNK_BYTES", 4 * V * 16)
    seen: dict[torch.dtype, list[tuple[int, int]]] = {}
    plain = fused_head._plain_chunk

    def spy(o, hidden, w, targets, extra, lo, hi, *rest):
        seen.setdefault(w.dtype, []).append((lo, hi))
        return plain(o, hidden, w, targets, extra, lo, hi, *rest)

    monkeypatch.setattr(fused_head, "_plain_chunk", spy)
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(N, H, dtype=dtype, requires_grad=True)
        w = torch.randn(V, H, dtype=dtype, requires_grad=True)
        loss, _ = fused_head.fused_logprobs_loss(h, w, torch.randint(0, V, (N,)), lambda lo, hi, lp, ex: -lp.sum())
        loss.backward()
    assert seen[torch.float32] == [(0, 16), (16, 32), (32, N)]
    assert seen[torch.bfloat16] == [(0, 32), (32, N)]


def test_the_weight_gradient_adds_the_chunk_product_to_the_fp32_accumulator_off_cuda():
    from asyncgrpo.trainer.fused_head import add_weight_grad, weight_grad_in_gemm

    g = torch.Generator().manual_seed(5)
    dz, h = torch.randn(9, V, generator=g).bfloat16(), torch.randn(9, H, generator=g).bfloat16()
    acc = torch.randn(V, H, generator=g)
    want = acc + (dz.T @ h).float()
    add_weight_grad(acc, dz, h)
    assert not weight_grad_in_gemm(torch.device("cpu"))
    assert torch.equal(acc, want)

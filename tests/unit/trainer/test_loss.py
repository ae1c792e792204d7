"""Policy loss (L1-L5) against formulas written out here, on a hand-made batch with logits as leaves."""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo.trainer.loss import loss_normalizer, policy_loss

CMIN, CMAX = 0.5, 5.0
L3 = math.log(3.0)


def _batch():
    """5 positions, vocab 6. Position 0 is uniform (hand-checked below); 4 is untrained with placeholders."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 6, generator=g, dtype=torch.float64)
    logits[0] = 0.0  # pi = 1/6 everywhere
    logits.requires_grad_(True)
    tokens = torch.tensor([2, 1, 3, 0, 5])
    logp_all = torch.log_softmax(logits.detach(), dim=-1)
    # Sampler log-prob of the sampled token: pos 0 mu=1/4 (r=2/3); pos 1 on-policy * 1.3 (r~1/1.3);
    # pos 2 the sampler gave it 10x less than the trainer (r=10 > C_max, masked); pos 3 r=0.4 < C_min (masked).
    slp = torch.stack(
        [
            torch.tensor(math.log(0.25), dtype=torch.float64),
            logp_all[1, 1] + math.log(1.3),
            logp_all[2, 3] - math.log(10.0),
            logp_all[3, 0] - math.log(0.4),
            torch.tensor(0.0, dtype=torch.float64),  # untrained placeholder
        ]
    )
    top_ids = torch.tensor([[2, 0, 4], [1, 4, 2], [3, 1, 0], [0, 5, 2], [0, 1, 2]])
    s_top = torch.tensor(
        [
            [math.log(0.25), math.log(0.25), math.log(0.125)],  # pos 0: r = 2/3, 2/3, 4/3
            [0.0, 0.0, -math.inf],  # filled below; last slot is padding
            [0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0],
            [-1.0, -2.0, -3.0],  # untrained position: must not matter
        ],
        dtype=torch.float64,
    )
    s_top[1, 0] = slp[1]
    s_top[1, 1] = logp_all[1, 4] + math.log(12.0)  # r = 1/12 < C_min: excluded from the centering sum
    s_top[2] = logp_all[2, top_ids[2]] + torch.tensor([-math.log(10.0), 0.1, -0.2], dtype=torch.float64)
    s_top[3] = logp_all[3, top_ids[3]] + torch.tensor([-math.log(0.4), 0.3, 0.0], dtype=torch.float64)
    adv = torch.tensor([1.5, -0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    return logits, tokens, slp, top_ids, s_top, adv, mask


def _our_loss(logits, tokens, slp, top_ids, s_top, adv, mask, normalizer, score_centering=True, **kw):
    logp_all = torch.log_softmax(logits, dim=-1)
    out = policy_loss(
        logp_all.gather(1, tokens[:, None]).squeeze(1),
        slp,
        adv,
        mask,
        normalizer,
        clip_min=CMIN,
        clip_max=CMAX,
        score_centering=score_centering,
        top_logprobs=logp_all.gather(1, top_ids),
        sampler_top_logprobs=s_top,
        **kw,
    )
    return out


def test_score_centering_value_and_gradient_match_direct_formula():
    logits, tokens, slp, top_ids, s_top, adv, mask = _batch()
    n_train = 4.0
    out = _our_loss(logits, tokens, slp, top_ids, s_top, adv, mask, n_train)
    (grad,) = torch.autograd.grad(out.loss, logits)

    # (a) gradient: the reference's formula (L3 in docs/spec.md) as a weighted log-prob loss, weights detached:
    #     -A_t [ f(r_t) log pi(o_t) - sum_v mu(v) f(r_v) log pi(v) ],   f(r) = r * 1[C_min <= r <= C_max]
    ref_logits = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(ref_logits, dim=-1)
    f = lambda r: r if CMIN <= r <= CMAX else 0.0
    terms = []
    value = 0.0
    for t in range(5):
        if not mask[t]:
            continue
        p = logp.detach()[t].exp()
        r_t = float(p[tokens[t]] / slp[t].exp())
        centering = 0.0
        mass_in_range = 0.0
        for k in range(3):
            mu = float(s_top[t, k].exp())
            if mu == 0.0:
                continue  # padding slot
            r_v = float(p[top_ids[t, k]]) / mu
            centering = centering + mu * f(r_v) * logp[t, top_ids[t, k]]
            mass_in_range += float(p[top_ids[t, k]]) if f(r_v) else 0.0
        terms.append(-float(adv[t]) * (f(r_t) * logp[t, tokens[t]] - centering))
        # value: -A_t (m_t r_t - sum_v m_v pi(v)), the module's surrogate written with python floats
        value += -float(adv[t]) * ((r_t if f(r_t) else 0.0) - mass_in_range)
    (ref_grad,) = torch.autograd.grad(sum(terms) / n_train, ref_logits)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)
    assert out.loss.item() == pytest.approx(value / n_train, rel=1e-10)

    # (b) position 0 by hand: pi = 1/6 for all 6 tokens, o = 2, mu(o) = 1/4 -> r = 2/3 (kept).
    # Top ids 2, 0, 4 with mu 1/4, 1/4, 1/8 -> r 2/3, 2/3, 4/3, all kept, so mu f(r) = pi = 1/6 each.
    # d log pi(k) / dz = e_k - pi, hence with A = 1.5 and normaliser 4:
    #   grad = -(1.5/4) [ 2/3 (e_2 - pi) - 1/6 (e_2 - pi) - 1/6 (e_0 - pi) - 1/6 (e_4 - pi) ]
    #        = -(0.375) [ 1/2 e_2 - 1/6 e_0 - 1/6 e_4 - 1/6 pi ]         (pi_v/6 = 1/36)
    #        = -(0.375/36) [ -7, -1, 17, -1, -7, -1 ] = [7, 1, -17, 1, 7, 1] * 0.0104166...
    hand = torch.tensor([7.0, 1.0, -17.0, 1.0, 7.0, 1.0], dtype=torch.float64) * 0.375 / 36
    torch.testing.assert_close(grad[0], hand, rtol=1e-12, atol=1e-14)
    # value of position 0: -1.5 * (2/3 - 3 * 1/6) / 4 = -0.0625
    # untrained position 4 gets no gradient at all
    assert torch.all(grad[4] == 0)


def test_mis_masking_excludes_out_of_range_tokens():
    logits, tokens, slp, top_ids, s_top, adv, mask = _batch()
    # Clipped surrogate: positions 2 (r = 10) and 3 (r = 0.4) are masked and get exactly zero gradient.
    out = _our_loss(logits, tokens, slp, top_ids, s_top, adv, mask, 4.0, score_centering=False)
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert torch.all(grad[2] == 0) and torch.all(grad[3] == 0) and torch.all(grad[4] == 0)
    assert grad[0].abs().sum() > 0
    assert torch.all(grad[1] == 0)  # not MIS: r = 1/1.3 < 1 - eps with A < 0, so the PPO clip binds
    # Score centering: a masked position keeps only its centering part -A sum_v mu f(r_v) grad log pi(v).
    out = _our_loss(logits, tokens, slp, top_ids, s_top, adv, mask, 4.0)
    (grad,) = torch.autograd.grad(out.loss, logits)
    ref = logits.detach().clone().requires_grad_(True)
    logp = torch.log_softmax(ref, dim=-1)
    p = logp.detach().exp()
    c = 0.0
    for k in range(3):
        r_v = float(p[2, top_ids[2, k]] / s_top[2, k].exp())
        if CMIN <= r_v <= CMAX:
            c = c + float(s_top[2, k].exp()) * r_v * logp[2, top_ids[2, k]]
    (ref_grad,) = torch.autograd.grad(float(adv[2]) * c / 4.0, ref)
    torch.testing.assert_close(grad[2], ref_grad[2], rtol=1e-10, atol=1e-12)
    # metrics: 2 of 4 trained tokens masked; ratio min 0.4, max 10
    m = {k: v for k, v, _ in out.metric_events()}
    assert m["sampling/masked_mean"] == pytest.approx(0.5)
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(0.4)
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(10.0)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(math.log(10.0))


def test_clipped_surrogate_matches_ppo_clip_on_hand_numbers():
    # ratios chosen by hand; sampler log-prob log(0.5) everywhere, eps_low = eps_high = 0.2
    ratios = torch.tensor([1.5, 0.7, 1.1, 0.7, 6.0, 0.9], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0, -2.0], dtype=torch.float64)
    slp = torch.full((6,), math.log(0.5), dtype=torch.float64)
    logp = (ratios.log() + slp).requires_grad_(True)
    out = policy_loss(logp, slp, adv, torch.ones(6, dtype=torch.bool), 6.0, score_centering=False)
    # per token -min(r A, clip(r, 0.8, 1.2) A) * 1[0.5 <= r <= 5]:
    #   1.5, +1 -> -min(1.5, 1.2) = -1.2 (clipped: no gradient)
    #   0.7, -1 -> -min(-0.7, -0.8) = 0.8 (clipped)
    #   1.1, +1 -> -1.1, d/dlogp = -r = -1.1
    #   0.7, +1 -> -min(0.7, 0.8) = -0.7 (pessimistic branch: unclipped), d/dlogp = -0.7
    #   6.0     -> masked: 0
    #   0.9, -2 -> -min(-1.8, -1.8) = 1.8, d/dlogp = -r A = 1.8
    expected = (-1.2 + 0.8 - 1.1 - 0.7 + 0.0 + 1.8) / 6
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    (g,) = torch.autograd.grad(out.loss, logp)
    torch.testing.assert_close(g, torch.tensor([0.0, 0.0, -1.1, -0.7, 0.0, 1.8], dtype=torch.float64) / 6)
    m = {k: v for k, v, _ in out.metric_events()}
    # clipped: low (r < 0.8 with A < 0) = token 1; high (r > 1.2 with A > 0) = tokens 0 and 4
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 6)
    assert m["clip_ratio/high_mean"] == pytest.approx(2 / 6)
    assert m["clip_ratio/region_mean"] == pytest.approx(3 / 6)
    assert m["sampling/masked_mean"] == pytest.approx(1 / 6)


def test_clip_metrics_per_completion_and_sampler_mass():
    # two samples: tokens 0-2 belong to sample 0, tokens 3-4 to sample 1; score centering counts r outside
    # [1 - eps, 1 + eps] regardless of the advantage's sign.
    ratios = torch.tensor([0.7, 1.0, 1.3, 0.6, 0.5], dtype=torch.float64)
    slp = torch.full((5,), math.log(0.5), dtype=torch.float64)
    logp = ratios.log() + slp
    s_top = torch.log(torch.tensor([[0.5, 0.3], [0.5, 0.2], [0.5, 0.1], [0.5, 0.4], [0.5, -1.0]])).double()
    s_top[4, 1] = -math.inf  # padding
    out = policy_loss(
        logp,
        slp,
        torch.ones(5, dtype=torch.float64),
        torch.ones(5, dtype=torch.bool),
        5.0,
        top_logprobs=s_top.clone(),
        sampler_top_logprobs=s_top,
        sample_index=torch.tensor([0, 0, 0, 1, 1]),
        entropy=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]),
    )
    m = {k: (v, w) for k, v, w in out.metric_events()}
    # low flags (r < 0.8): tokens 0, 3, 4 -> sample 0: 1/3, sample 1: 2/2; high (r > 1.2): token 2 -> 1/3, 0
    assert m["clip_ratio/low_min"][0] == pytest.approx(1 / 3)
    assert m["clip_ratio/high_max"][0] == pytest.approx(1 / 3)
    # a packed row passes its sample count (no host sync for the size); samples without trained tokens (2-4)
    # are left out of the min/max, not counted as 0
    sized = policy_loss(logp, slp, torch.ones(5, dtype=torch.float64), torch.ones(5, dtype=torch.bool), 5.0,
                        top_logprobs=s_top.clone(), sampler_top_logprobs=s_top,
                        sample_index=torch.tensor([0, 0, 0, 1, 1]), num_samples=5)  # fmt: skip
    assert {k: (v, w) for k, v, w in sized.metric_events()}["clip_ratio/low_min"] == m["clip_ratio/low_min"]
    # the events are the 0-d tensors' values, read in one copy
    assert m == {k: (float(v), float(w)) for k, (v, w) in out.metrics.items() if k in m} and len(m) == len(out.metrics)
    assert m["clip_ratio/low_mean"] == (pytest.approx(3 / 5), 5.0)
    # covered sampler mass: 0.8, 0.7, 0.6, 0.9, 0.5 -> mean 0.7
    assert m["sampling/sampler_mass"][0] == pytest.approx(0.7)
    assert m["entropy"] == (pytest.approx(3.0), 5.0)


def test_on_policy_renormalised_candidates_give_unit_ratios():
    # top-k sampling: the sampler drew from the 3 best of 6 tokens, renormalised over that set. The trainer
    # renormalises its logits over the same candidate sets (done here by hand), so an on-policy batch has r = 1;
    # full-vocabulary normalisation would bias every ratio below 1.
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -2.0, 0.0], [0.1, 0.2, 3.0, 1.0, -1.0, 0.0]], dtype=torch.float64)
    cand = torch.tensor([[0, 1, 2], [2, 3, 5]])
    tokens = torch.tensor([1, 3])
    cand_logits = logits.gather(1, cand)
    lse = torch.logsumexp(cand_logits, dim=-1)
    renorm = logits.gather(1, tokens[:, None]).squeeze(1) - lse
    sampler = renorm.clone()  # what a processed_logprobs server reports for the same weights
    out = policy_loss(renorm, sampler, torch.ones(2), torch.ones(2, dtype=torch.bool), 2.0, score_centering=False)
    m = {k: v for k, v, _ in out.metric_events()}
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0)
    full = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    biased = policy_loss(full, sampler, torch.ones(2), torch.ones(2, dtype=torch.bool), 2.0, score_centering=False)
    assert {k: v for k, v, _ in biased.metric_events()}["sampling/importance_sampling_ratio/max"] < 0.99


def _token_losses(logits, tokens, slp, adv):
    """Direct per-token clipped-surrogate losses (eps 0.2, C 0.5..5), written independently."""
    logp = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    r = torch.exp(logp - slp)
    keep = ((r.detach() >= CMIN) & (r.detach() <= CMAX)).double()
    return -keep * torch.minimum(r * adv, r.clamp(0.8, 1.2) * adv)


def _random_batch(n, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, 7, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, 7, (n,), generator=g)
    slp = torch.log_softmax(logits + 0.3 * torch.randn(n, 7, generator=g, dtype=torch.float64), -1)
    slp = slp.gather(1, tokens[:, None]).squeeze(1)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return logits, tokens, slp, adv


def test_normalisation_with_gradient_accumulation():
    logits, tokens, slp, adv = _random_batch(10, seed=1)
    mask = torch.ones(10, dtype=torch.bool)
    mask[[2, 7]] = False
    ga = 2
    micro = [slice(0, 6), slice(6, 10)]  # unequal micro-batches: 5 and 3 trained tokens
    leaf = logits.clone().requires_grad_(True)
    total = torch.zeros_like(leaf)
    for sl in micro:
        n_mb = int(mask[sl].sum())
        lp = torch.log_softmax(leaf[sl], -1).gather(1, tokens[sl][:, None]).squeeze(1)
        out = policy_loss(lp, slp[sl], adv[sl], mask[sl], loss_normalizer(n_mb, ga), score_centering=False)
        (g,) = torch.autograd.grad(out.loss, leaf)
        total += g
    # document: each micro-batch normalised by its own trained tokens, averaged over the GA micro-batches
    ref = logits.clone().requires_grad_(True)
    per_tok = _token_losses(ref, tokens, slp, adv) * mask
    target = sum(per_tok[sl].sum() / mask[sl].sum() for sl in micro) / ga
    (ref_g,) = torch.autograd.grad(target, ref)
    torch.testing.assert_close(total, ref_g, rtol=1e-10, atol=1e-12)

    # equal micro-batches: the summed gradient is the full batch's normalised by the global token count
    mask = torch.ones(10, dtype=torch.bool)
    total = torch.zeros_like(leaf)
    for sl in (slice(0, 5), slice(5, 10)):
        lp = torch.log_softmax(leaf[sl], -1).gather(1, tokens[sl][:, None]).squeeze(1)
        out = policy_loss(lp, slp[sl], adv[sl], mask[sl], loss_normalizer(5, ga), score_centering=False)
        total += torch.autograd.grad(out.loss, leaf)[0]
    (full_g,) = torch.autograd.grad(_token_losses(ref, tokens, slp, adv).sum() / 10, ref)
    torch.testing.assert_close(total, full_g, rtol=1e-10, atol=1e-12)


def test_normalisation_across_processes_with_averaged_gradients():
    # One micro-batch split over 2 processes (4 + 2 trained tokens); DDP/FSDP average the two gradients.
    logits, tokens, slp, adv = _random_batch(6, seed=2)
    mask = torch.ones(6, dtype=torch.bool)
    global_tokens = 6
    leaf = logits.clone().requires_grad_(True)
    grads = []
    for sl in (slice(0, 4), slice(4, 6)):
        lp = torch.log_softmax(leaf[sl], -1).gather(1, tokens[sl][:, None]).squeeze(1)
        norm = loss_normalizer(global_tokens, 1, num_processes=2)
        out = policy_loss(lp, slp[sl], adv[sl], mask[sl], norm, score_centering=False)
        grads.append(torch.autograd.grad(out.loss, leaf)[0])
    averaged = (grads[0] + grads[1]) / 2
    ref = logits.clone().requires_grad_(True)
    (ref_g,) = torch.autograd.grad(_token_losses(ref, tokens, slp, adv).sum() / global_tokens, ref)
    torch.testing.assert_close(averaged, ref_g, rtol=1e-10, atol=1e-12)
    assert loss_normalizer(0, 4) == 4  # an empty micro-batch does not divide by zero


def test_empty_micro_batch_and_missing_top_logprobs():
    lp = torch.zeros(3, requires_grad=True)
    out = policy_loss(lp, torch.zeros(3), torch.ones(3), torch.zeros(3, dtype=torch.bool), 1.0, score_centering=False)
    assert out.loss.item() == 0.0
    assert math.isnan({k: v for k, v, _ in out.metric_events()}["sampling/importance_sampling_ratio/max"])
    with pytest.raises(ValueError, match="score_centering needs top_logprobs"):
        policy_loss(lp, torch.zeros(3), torch.ones(3), torch.ones(3, dtype=torch.bool), 1.0)


def test_metric_events_read_tensors_and_plain_numbers_in_order():
    from asyncgrpo.trainer.loss import LossOutput

    out = LossOutput(torch.zeros(()), {"a": (torch.tensor(2.5), 3.0), "b": (1.5, torch.tensor([4.0])),
                                       "c": (torch.tensor(math.nan, dtype=torch.float64), torch.tensor(1))})  # fmt: skip
    events = out.metric_events()
    assert [(n, v, w) for n, v, w in events[:2]] == [("a", 2.5, 3.0), ("b", 1.5, 4.0)]
    assert events[2][0] == "c" and math.isnan(events[2][1]) and events[2][2] == 1.0
    assert all(isinstance(x, float) for _, v, w in events for x in (v, w))

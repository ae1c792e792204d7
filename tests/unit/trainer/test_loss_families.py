"""TRL's loss families and the sampler corrections against the papers' formulas, written out here in float64.

The reference loops over sequences and tokens in plain Python: GSPO's sequence ratio is differentiated through
every token's log-prob (not the GSPO-token form the library computes), corrections follow their definitions
(TIS, MIS, IcePop), and each family's normaliser is a number worked out by hand. One hand-made batch: three
sequences of unequal lengths, tool-result tokens masked out (with placeholder sampler log-probs that would blow
up the loss if they counted), ratios inside and outside the trust region and the correction bands.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncgrpo.trainer.loss_families import FamilySettings, family_loss, family_normalizer
from asyncgrpo.trainer.sampler_correction import Correction

CMIN, CMAX = 0.5, 5.0
EPS_LOW, EPS_HIGH = 0.2, 0.28
CISPO_CAP = 1.15  # below some ratios of the batch, so the cap binds on some tokens and not others
# (sequence, trainer/sampler ratio q, trained?): q is exp(log pi_trainer - log pi_sampler) of the token.
TOKENS = [
    (0, 1.0, True), (0, 7.0, True), (0, 1e-3, False), (0, 2.0, True), (0, 1.3, True),  # a tool token inside
    (1, 0.85, True), (1, 0.3, True),
    (2, 1.05, True), (2, 0.95, True), (2, 0.9, True), (2, 50.0, False), (2, 1.0, True), (2, 1.1, True),
]  # fmt: skip
ADV = [1.2, -0.7, 0.9]
V = 7
MODES = [None, "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop"]
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]
LEVELS = ["token", "sequence", "sequence_token"]


def _batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(len(TOKENS), V, generator=g, dtype=torch.float64).requires_grad_(True)
    targets = torch.randint(0, V, (len(TOKENS),), generator=g)
    lp = torch.log_softmax(logits.detach(), -1).gather(1, targets[:, None])[:, 0]
    sampler = lp - torch.tensor([math.log(q) for _, q, _ in TOKENS], dtype=torch.float64)
    seq = torch.tensor([s for s, _, _ in TOKENS])
    mask = torch.tensor([m for _, _, m in TOKENS])
    adv = torch.tensor([ADV[s] for s, _, _ in TOKENS], dtype=torch.float64)
    return logits, targets, sampler, seq, mask, adv


def _weight(mode, q, big_q):
    """The correction weight of one token from its ratio q and its sequence's ratio big_q (definitions)."""
    if mode is None:
        return 1.0
    if mode == "token_truncate":
        return min(max(q, CMIN), CMAX)
    if mode == "token_mask":
        return q if CMIN <= q <= CMAX else 0.0
    if mode == "sequence_truncate":
        return min(max(big_q, CMIN), CMAX)
    if mode == "sequence_mask":
        return big_q if CMIN <= big_q <= CMAX else 0.0
    return q if 1 / CMAX <= q <= CMAX else 0.0  # icepop


def _surrogate(ratio, a):
    clipped = torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH)
    return -torch.minimum(ratio * a, clipped * a)


def _reference(logits, targets, sampler, loss_type, level, mode, normalizer):
    lp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    total = torch.zeros((), dtype=torch.float64)
    for i, a in enumerate(ADV):
        toks = [t for t, (s, _, m) in enumerate(TOKENS) if s == i and m]
        q = {t: math.exp(float(lp[t].detach() - sampler[t])) for t in toks}
        big_q = math.exp(sum(float(lp[t].detach() - sampler[t]) for t in toks))
        w = {t: _weight(mode, q[t], big_q) for t in toks}
        old = {t: sampler[t] if mode is None else lp[t].detach() for t in toks}
        if level == "token":
            ratio = {t: torch.exp(lp[t] - old[t]) for t in toks}
        else:
            s_i = torch.exp(sum(lp[t] - old[t] for t in toks) / len(toks))  # GSPO: through every token
            if level == "sequence_token":
                ratio = {t: s_i.detach() * torch.exp(lp[t] - lp[t].detach()) for t in toks}
            else:
                ratio = {t: s_i for t in toks}
        if loss_type == "cispo":
            seq_sum = sum(-w[t] * torch.clamp(ratio[t].detach(), max=CISPO_CAP) * a * lp[t] for t in toks)
        elif level == "sequence":  # GSPO's sequence term, weighted by the sum of its tokens' weights
            seq_sum = sum(w.values()) * _surrogate(ratio[toks[0]], a)
        else:
            seq_sum = sum(w[t] * _surrogate(ratio[t], a) for t in toks)
        total = total + (seq_sum / len(toks) if loss_type == "grpo" else seq_sum)
    return total / normalizer


def test_family_normalizers_by_hand():
    # 11 trained tokens, 3 sequences in this micro-batch; 30 in the step; max_completion_length 8; GA 2; 2 processes
    assert family_normalizer("grpo", 11, 3, 30, 8, 2, 2) == 3 * 2 / 2
    assert family_normalizer("bnpo", 11, 3, 30, 8, 2, 2) == 11 * 2 / 2
    assert family_normalizer("asyncgrpo", 11, 3, 30, 8, 2, 2) == 11 * 2 / 2
    assert family_normalizer("dr_grpo", 11, 3, 30, 8, 2, 2) == 3 * 8 * 2 / 2
    assert family_normalizer("dapo", 11, 3, 30, 8, 2, 2) == 30 / 2
    assert family_normalizer("cispo", 11, 3, 30, 8, 2, 2) == 30 / 2
    assert family_normalizer("dapo", 0, 0, 0, 8, 2, 1) == 1  # an empty step does not divide by zero


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_value_and_logit_gradient_match_the_formula(loss_type, mode, level):
    logits, targets, sampler, seq, mask, adv = _batch()
    eps_high = CISPO_CAP if loss_type == "cispo" else EPS_HIGH
    settings = FamilySettings(loss_type, level, EPS_LOW, eps_high, Correction(mode, CMIN, CMAX))
    norm = {"grpo": 3.0, "bnpo": 11.0, "dr_grpo": 24.0, "dapo": 30.0, "cispo": 30.0}[loss_type]
    lp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    ours = family_loss(lp, sampler, adv, mask, seq, norm, settings).loss
    (g_ours,) = torch.autograd.grad(ours, logits)
    ref = _reference(logits, targets, sampler, loss_type, level, mode, norm)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert abs(float(ours) - float(ref)) < 1e-10
    assert torch.allclose(g_ours, g_ref, atol=1e-10, rtol=0)
    assert g_ours[~mask].abs().max() == 0  # tool tokens get no gradient
    assert g_ours[mask].abs().max() > 0


def test_batch_covers_clipped_and_unclipped_tokens_and_sequences():
    """The cases above only test something if the batch has both sides of every boundary: check it has."""
    logits, targets, sampler, seq, mask, adv = _batch()
    lp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]

    def metrics(settings):
        out = family_loss(lp, sampler, adv, mask, seq, 1.0, settings)
        return {k: v for k, v, _ in out.metric_events()}

    token = metrics(FamilySettings("grpo", "token", EPS_LOW, EPS_HIGH, Correction(None)))
    assert 0 < token["clip_ratio/region_mean"] < 1  # the trust region binds on some tokens only
    seqs = metrics(FamilySettings("grpo", "sequence", EPS_LOW, EPS_HIGH, Correction(None)))
    assert seqs["clip_ratio/region_mean"] == pytest.approx(6 / 11)  # sequences 0 and 1 clipped, 2 not
    mis = metrics(FamilySettings("dapo", "token", EPS_LOW, EPS_HIGH, Correction("token_mask", CMIN, CMAX)))
    assert mis["sampling/masked_mean"] == pytest.approx(2 / 11)  # q = 7.0 and 0.3
    assert mis["sampling/importance_sampling_ratio/max"] == pytest.approx(7.0)
    assert mis["sampling/importance_sampling_ratio/min"] == pytest.approx(0.3)
    assert mis["clip_ratio/region_mean"] == 0  # with the correction on the old policy is the trainer's: ratio 1
    icepop = metrics(FamilySettings("dapo", "token", EPS_LOW, EPS_HIGH, Correction("icepop", CMIN, CMAX)))
    assert icepop["sampling/masked_mean"] == pytest.approx(1 / 11)  # 0.3 lies inside [1/5, 5]
    tis = metrics(FamilySettings("dapo", "token", EPS_LOW, EPS_HIGH, Correction("token_truncate", CMIN, CMAX)))
    assert tis["sampling/truncated_mean"] == pytest.approx(2 / 11) and tis["sampling/masked_mean"] == 0
    seq_mask = metrics(FamilySettings("dapo", "token", EPS_LOW, EPS_HIGH, Correction("sequence_mask", CMIN, CMAX)))
    assert seq_mask["sampling/sequence_masked_mean"] == pytest.approx(2 / 3)  # Q = 27.3 and 0.255
    assert seq_mask["sampling/masked_mean"] == pytest.approx(6 / 11)
    assert seq_mask["sampling/sequence_ratio/max"] == pytest.approx(7.0 * 2.0 * 1.3)
    cispo = metrics(FamilySettings("cispo", "token", EPS_LOW, CISPO_CAP, Correction(None)))
    assert cispo["clip_ratio/high_mean"] == pytest.approx(3 / 11)  # 7.0, 2.0, 1.3 capped at 1.15


def test_gspo_equals_gspo_token_without_token_weights():
    """The GSPO paper: with one advantage per sequence, GSPO and GSPO-token have the same value and gradient."""
    logits, targets, sampler, seq, mask, adv = _batch()
    grads = []
    for level in ("sequence", "sequence_token"):
        lp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
        s = FamilySettings("grpo", level, EPS_LOW, EPS_HIGH, Correction("sequence_truncate", CMIN, CMAX))
        loss = family_loss(lp, sampler, adv, mask, seq, 3.0, s).loss
        grads.append((float(loss), torch.autograd.grad(loss, logits)[0]))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-12)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-12, rtol=0)

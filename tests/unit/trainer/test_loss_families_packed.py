"""TRL's loss families through the packed path: fused LM head = recomputing head = full logits, and packed in
prefix tries = each sample forwarded alone (tiny CPU model; multi-turn samples whose tool results are not trained).

GSPO's sequence ratio and the sequence-level corrections need every token of a sequence; the packed path gets
them from a no-gradient head pass first. These tests check that the result is the unpacked batch's loss and
gradient, with sequences that span several head chunks.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from asyncgrpo.packing.attention import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.trainer.loss_families import FamilySettings, family_loss
from asyncgrpo.trainer.packed_loss import PolicyLossSettings, packed_policy_loss
from asyncgrpo.trainer.sampler_correction import Correction
from tests.helpers.reference import lora_model
from tests.helpers.synthetic import random_tree_samples

N, H, V = 29, 12, 40
CASES = {
    "gspo": FamilySettings("grpo", "sequence", 0.02, 0.03, Correction(None)),  # trust region vs the sampler
    "gspo_token_seqmask": FamilySettings("grpo", "sequence_token", 0.2, 0.28, Correction("sequence_mask", 0.5, 2.0)),
    "grpo_seqtrunc": FamilySettings("grpo", "token", 0.2, 0.28, Correction("sequence_truncate", 0.8, 1.2)),
    "dapo_mask": FamilySettings("dapo", "token", 0.2, 0.28, Correction("token_mask", 0.9, 1.1)),
    "dr_grpo_icepop": FamilySettings("dr_grpo", "token", 0.2, 0.28, Correction("icepop", 0.5, 1.1)),
    "cispo_tis": FamilySettings("cispo", "sequence", 0.2, 1.05, Correction("token_truncate", 0.95, 1.05)),
    "bnpo_off": FamilySettings("bnpo", "token", 0.05, 0.05, Correction(None)),
}


def _head_row(seed: int) -> SimpleNamespace:
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        target_ids=torch.randint(0, V, (N,), generator=g),
        old_logprobs=-torch.rand(N, generator=g) * 3 - 2.5,
        advantages=torch.randn(N, generator=g),
        sampler_topn_ids=None, sampler_topn_logprobs=None, candidates=None,
        entry_sample=torch.tensor([0] * 11 + [1] * 3 + [2] * 15),  # sequences across chunks of 4
    )  # fmt: skip


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_packed_head_matches_full_logits(case, fused):
    torch.manual_seed(0)
    h0, w0 = torch.randn(N, H, dtype=torch.float64), torch.randn(V, H, dtype=torch.float64) * 0.5
    row = _head_row(1)
    with torch.no_grad():  # sampler log-probs near the policy's: ratios around 1, a few far off
        lp0 = (h0 @ w0.T / 0.8).log_softmax(-1).gather(1, row.target_ids[:, None])[:, 0].float()
        row.old_logprobs = lp0 + 0.1 * row.old_logprobs.add(4.0) + (torch.arange(N) % 9 == 0) * 1.5
    s = PolicyLossSettings(temperature=0.8, fused_lm_head=fused, chunk_size=4, family=CASES[case])
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    lp = (h @ w.T / 0.8).log_softmax(-1).gather(1, row.target_ids[:, None])[:, 0]
    mask = torch.ones(N, dtype=torch.bool)
    ref = family_loss(lp, row.old_logprobs, row.advantages, mask, row.entry_sample, 7.0, CASES[case])
    ref.loss.backward()
    h2, w2 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    got = packed_policy_loss(h2, w2, row, 7.0, s)
    got.loss.backward()
    assert abs(got.loss.item() - ref.loss.item()) <= 1e-6 * max(1.0, abs(ref.loss.item()))  # fp32 per-token log-probs
    assert (h2.grad - h.grad).abs().max() <= 1e-5 * h.grad.abs().max()
    assert (w2.grad - w.grad).abs().max() <= 1e-5 * w.grad.abs().max()
    assert h.grad.abs().max() > 0
    for name, (value, _) in ref.metrics.items():
        if name != "entropy":
            assert torch.allclose(got.metrics[name][0].double(), value.double(), atol=1e-6, equal_nan=True), name


VOCAB = 97


def _model(lora: bool) -> torch.nn.Module:
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    return lora_model(model, seed=5) if lora else model


def _near_policy_samples(model, rng) -> list[PackSample]:
    """random_tree_samples with sampler log-probs near the model's own (ratios around 1, some far off)."""
    out = []
    for s in random_tree_samples(rng, vocab_size=VOCAB, num_groups=3):
        with torch.no_grad():
            ids = torch.from_numpy(s.token_ids)[None]
            logp = model(input_ids=ids, use_cache=False).logits[0].log_softmax(-1)
        t = np.flatnonzero(s.loss_mask)
        old = np.zeros(len(s.token_ids), dtype=np.float32)
        true = logp[t - 1].gather(1, ids[0, t][:, None])[:, 0].numpy()
        old[t] = true + rng.normal(0, 0.15, len(t)) + (rng.random(len(t)) < 0.15) * rng.choice([-1.5, 1.5], len(t))
        out.append(PackSample(s.token_ids, s.loss_mask, old, s.advantage, s.group_id))
    return out


def _unpacked(model, samples, norm, fam):
    """Each sample alone through the model; the family's loss of the concatenated trained tokens."""
    model.zero_grad()
    lps, old, adv, seq = [], [], [], []
    for i, s in enumerate(samples):
        ids = torch.from_numpy(s.token_ids)[None]
        logp = model(input_ids=ids, use_cache=False).logits[0].log_softmax(-1)
        t = torch.from_numpy(np.flatnonzero(s.loss_mask))
        lps.append(logp[t - 1].gather(1, ids[0, t][:, None])[:, 0])
        old.append(torch.from_numpy(np.asarray(s.old_logprobs, dtype=np.float32))[t])
        adv.append(torch.full((len(t),), s.advantage))
        seq.append(torch.full((len(t),), i))
    lp = torch.cat(lps)
    out = family_loss(lp, torch.cat(old), torch.cat(adv), torch.ones_like(lp, dtype=torch.bool), torch.cat(seq),
                      norm, fam)  # fmt: skip
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case,lora", [("gspo", False), ("grpo_seqtrunc", False), ("cispo_tis", False),
                                       ("gspo_token_seqmask", True), ("dapo_mask", True)])  # fmt: skip
def test_packed_in_tries_equals_unpacked(case, lora):
    rng = np.random.default_rng(7)
    model = _model(lora)
    samples = _near_policy_samples(model, rng)
    row = pack_samples(samples)
    assert row.num_tokens < row.num_flat_tokens  # prefixes were shared
    fam = CASES[case]
    ref, ref_grads = _unpacked(model, samples, 9.0, fam)
    use_tree_attention(model)
    model.zero_grad()
    hidden = packed_hidden_states(model, row, build_plan(row, "sdpa"))
    head = model.get_output_embeddings().weight
    got = packed_policy_loss(hidden[row.pred_index], head, row, 9.0, PolicyLossSettings(chunk_size=8, family=fam))
    got.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert abs(got.loss.item() - ref.loss.item()) <= 1e-5
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= 1e-4 * max(1.0, ref_grads[name].abs().max().item()), name
    events = {k: v for k, v, _ in got.metric_events()}
    ref_events = {k: v for k, v, _ in ref.metric_events()}
    for key in ("sampling/masked_mean", "sampling/truncated_mean", "clip_ratio/region_mean", "policy_ratio/max"):
        assert events[key] == pytest.approx(ref_events[key], abs=1e-5), key


def test_bf16_head_gives_the_fp32_loss_within_bf16_rounding():
    """The bf16 path: log-probs and ratios are taken in fp32 from the bf16 logits (as the reference objective)."""
    torch.manual_seed(1)
    row = _head_row(2)
    h, w = torch.randn(N, H), torch.randn(V, H) * 0.5
    lp0 = (h @ w.T).log_softmax(-1).gather(1, row.target_ids[:, None])[:, 0]
    row.old_logprobs = lp0 + 0.05 * torch.randn(N)
    fam = CASES["gspo_token_seqmask"]
    ref = packed_policy_loss(h, w, row, 7.0, PolicyLossSettings(chunk_size=4, family=fam)).loss
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    got = packed_policy_loss(hb, wb, row, 7.0, PolicyLossSettings(chunk_size=4, family=fam))
    got.loss.backward()
    assert got.loss.dtype == torch.float32 and torch.isfinite(hb.grad.float()).all() and hb.grad.abs().max() > 0
    assert abs(got.loss.item() - ref.item()) <= 0.05 * max(1.0, abs(ref.item()))

"""MoE in the packed trainer (SPEC L6): packed log-probs, router loss and gradients == the unpacked model's own.

References: each sample forwarded alone by transformers (log-probs), and the model's own ``aux_loss`` of the
unpacked micro-batch as one right-padded batch with an attention mask (transformers' ``load_balancing_loss_func``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, OlmoeConfig, Qwen3MoeConfig

from asyncgrpo.packing.attention import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.trainer.logprobs import selective_logprobs
from asyncgrpo.trainer.moe import experts_per_token, resolve_router_aux_coef, router_aux_loss
from tests.helpers.reference import unpacked_logprobs_and_grads
from tests.helpers.synthetic import random_tree_samples

VOCAB = 97
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


def _config(arch: str):
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(head_dim=8, moe_intermediate_size=32, router_aux_loss_coef=0.01, **COMMON)
    return OlmoeConfig(router_aux_loss_coef=0.01, **COMMON)


def _model(arch: str) -> torch.nn.Module:
    if arch == "qwen3_5_moe":  # Gated DeltaNet hybrid with MoE layers and a shared expert (packing/deltanet.py)
        from tests.unit.packing.test_packing_deltanet import hybrid_model

        model = hybrid_model("qwen3_5_moe")
        model.set_attn_implementation("sdpa")
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # sharper routers than the 0.02-std init: top-k choices far from ties
        for name, p in model.named_parameters():
            if "gate" in name and p.dim() == 2 and p.shape[0] == COMMON["num_experts"]:
                p.mul_(20.0)
    return model


def _unpacked(model, samples, weights):
    """Per-sample log-probs; the model's aux loss over the padded batch; grads of each part separately."""
    model.set_attn_implementation("sdpa")
    lp, lp_grads = unpacked_logprobs_and_grads(model, samples, weights)
    model.zero_grad()
    longest = max(len(s.token_ids) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s.token_ids)] = torch.from_numpy(s.token_ids)
        mask[i, : len(s.token_ids)] = 1
    aux = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    aux.backward()
    aux_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp, lp_grads, aux.detach(), aux_grads


def _packed(model, row, weights):
    """What the trainer runs: tree attention, router logits from the same forward, weighted router loss."""
    use_tree_attention(model)
    model.zero_grad()
    router: list[torch.Tensor] = []
    hidden = packed_hidden_states(model, row, build_plan(row, "sdpa"), router_logits=router)
    head = model.get_output_embeddings().weight
    lp = selective_logprobs(hidden[row.pred_index], head, row.target_ids, chunk_size=16).logprobs
    aux = router_aux_loss(router, row.path_count, experts_per_token(model.config))
    (lp * weights).sum().backward(retain_graph=True)
    lp_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    aux.backward()
    aux_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), lp_grads, aux.detach(), aux_grads, len(router)


def _close(got: dict, ref: dict, tol: float = 1e-4) -> None:
    assert got.keys() == ref.keys()
    for name, g in got.items():
        assert (g - ref[name]).abs().max().item() <= tol, name


@pytest.mark.parametrize(
    ("arch", "checkpointing"),
    [("qwen3_moe", False), ("qwen3_moe", True), ("olmoe", False), ("olmoe", True), ("qwen3_5_moe", False)],
)
def test_packed_logprobs_router_loss_and_grads_match_unpacked(arch, checkpointing):
    rng = np.random.default_rng(11)
    samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=3)  # forks at several depths, 1-token turns
    row = pack_samples(samples)
    assert row.num_tokens < row.num_flat_tokens  # prefixes are shared...
    assert int(row.path_count.sum()) == row.num_flat_tokens  # ...and each shared token counts once per sample
    model = _model(arch)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()  # checkpointing runs only in training mode (no dropout in these configs)
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_lp_grads, ref_aux, ref_aux_grads = _unpacked(model, samples, weights)
    lp, lp_grads, aux, aux_grads, layers = _packed(model, row, weights)
    assert layers == model.config.num_hidden_layers
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    _close(lp_grads, ref_lp_grads)
    assert abs(aux.item() - ref_aux.item()) <= 1e-5 and aux.item() > 0
    router_grads = [g for n, g in aux_grads.items() if "gate" in n and g.shape[0] == COMMON["num_experts"]]
    assert router_grads and all(g.abs().max() > 1e-3 for g in router_grads)  # the router loss does train
    _close(aux_grads, ref_aux_grads)


def test_router_loss_by_hand():
    """Two layers, three tokens (weights 2, 1, 0), two experts, top-1: the formula worked out on paper."""
    l1 = torch.log(torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]]))
    l2 = torch.log(torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.1, 0.9]]))
    got = router_aux_loss([l1, l2], torch.tensor([2, 1, 0]), top_k=1)
    # weighted rows (2 x token 0, 1 x token 1) over both layers: total weight 6
    f = torch.tensor([(2 + 0) + (2 + 1), (0 + 1) + (0 + 0)]) / 6  # expert 0 wins token 0 twice, token 1 once (L2)
    p = torch.tensor([2 * 0.9 + 0.2 + 2 * 0.7 + 0.6, 2 * 0.1 + 0.8 + 2 * 0.3 + 0.4]) / 6
    assert math.isclose(got.item(), 2 * float((f * p).sum()), rel_tol=1e-6)


def test_coefficient_resolution():
    moe = _config("qwen3_moe")
    dense = LlamaConfig(**{k: v for k, v in COMMON.items() if not k.startswith("num_experts")})
    assert resolve_router_aux_coef(moe, None) == 0.01  # the model config's value
    assert resolve_router_aux_coef(moe, 0.0) == 0.0 and resolve_router_aux_coef(moe, 0.3) == 0.3
    assert resolve_router_aux_coef(dense, None) == 0.0 and resolve_router_aux_coef(dense, 0.0) == 0.0
    with pytest.raises(ValueError, match="not a mixture-of-experts model.*router_aux_loss_coef"):
        resolve_router_aux_coef(dense, 0.01)

"""Gated DeltaNet hybrids in the trie (SPEC P6): packed forward/backward == each sample forwarded alone by HF.

The reference is transformers' own unpacked forward of each sample (its torch chunked delta rule and
causal convolution over the plain sequence); the packed side is what the trainer runs: tree attention,
the trie-aware DeltaNet layers and the chunked log-prob module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.packing.attention import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.linear_attention import build_linear_plan, tree_causal_conv, tree_gated_delta_rule
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.trainer.logprobs import selective_logprobs
from tests.helpers.reference import unpacked_logprobs_and_grads
from tests.helpers.synthetic import random_tree_samples

VOCAB = 97
HYBRID = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Small batched triangular solves are far slower with 2 threads on a busy 2-core machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def hybrid_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random Qwen3.5 (text), Qwen3.5-MoE or Qwen3-Next (4 experts) hybrid: 3 DeltaNet + 1 attention layer."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    if family == "qwen3_5":
        cfg = Qwen3_5TextConfig(**HYBRID)
    elif family == "qwen3_5_moe":
        cfg = Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=32, **HYBRID)  # fmt: skip
    else:
        cfg = Qwen3NextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32, **HYBRID)  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # random decays and write strengths, so the state really carries information
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-3.0, 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
    return model


def _reference(model, samples, weights):
    """Per-sample unpacked HF forward: trained-token log-probs and grads of sum(weights * logp)."""
    return unpacked_logprobs_and_grads(model, samples, weights)


def _packed(model, row, weights, chunk):
    use_tree_attention(model)
    model.zero_grad()
    hidden = packed_hidden_states(model, row, build_plan(row, "sdpa", linear_attention=True, linear_chunk=chunk))
    head = model.get_output_embeddings().weight
    lp = selective_logprobs(hidden[row.pred_index], head, row.target_ids, chunk_size=16).logprobs
    (lp * weights).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _deep_tree_samples(rng):
    """Forks at several depths, single-token segments, long chains crossing chunk borders, several groups."""
    out = random_tree_samples(rng, vocab_size=VOCAB, num_groups=3)
    trunk = list(rng.integers(0, VOCAB, size=11))
    for g, depth in enumerate((3, 7, 11)):
        for _ in range(2):
            tail = list(rng.integers(0, VOCAB, size=int(rng.integers(1, 9))))
            ids = trunk[:depth] + tail
            mask = [0] * depth + [1] * len(tail)
            out.append(PackSample(ids, mask, [0.0] * len(ids), float(rng.standard_normal()), group_id=100 + g))
    return out


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("chunk", [3, 64])
def test_packed_hybrid_matches_unpacked(family, chunk):
    rng = np.random.default_rng(3)
    samples = _deep_tree_samples(rng)
    row = pack_samples(samples)
    assert row.num_tokens < row.num_flat_tokens  # sharing happened
    seg_len = (row.seg_end - row.seg_start).numpy()
    assert (seg_len == 1).any() and (np.bincount(row.seg_parent.numpy()[row.seg_parent.numpy() >= 0]) >= 2).sum() >= 3
    model = hybrid_model(family)
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_grads = _reference(model, samples, weights)
    lp, grads = _packed(model, row, weights, chunk)
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    assert grads.keys() == ref_grads.keys()
    assert any("A_log" in n for n in grads) and any("conv1d" in n for n in grads)
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= 1e-4, name


def test_qwen3_5_vision_language_text_model_matches_unpacked():
    """A Qwen3.5 VLM checkpoint trained on text: its DeltaNet text model packs exactly (tower untouched)."""
    from transformers import AutoModelForImageTextToText, Qwen3_5Config

    text = {k: v for k, v in HYBRID.items() if k != "tie_word_embeddings"}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 8,
              "out_hidden_size": HYBRID["hidden_size"], "num_position_embeddings": 64}  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(
        Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False), dtype=torch.float32
    )
    rng = np.random.default_rng(6)
    samples = _deep_tree_samples(rng)
    row = pack_samples(samples)
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_grads = _reference(model, samples, weights)
    lp, grads = _packed(model, row, weights, 4)
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    assert grads.keys() == ref_grads.keys() and any("linear_attn" in n for n in grads)
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= 1e-4, name


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_hybrid_matches_unpacked(reentrant):
    """Gradient checkpointing recomputes the DeltaNet layers with the plan: same log-probs and gradients."""
    rng = np.random.default_rng(5)
    samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=2)
    row = pack_samples(samples)
    model = hybrid_model("qwen3_5", seed=1)
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_grads = _reference(model, samples, weights)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    lp, grads = _packed(model, row, weights, 4)
    assert grads.keys() == ref_grads.keys()
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= 1e-4, name


def test_lora_on_deltanet_projections_matches_unpacked():
    """LoRA adapters on the DeltaNet projections (and attention) change the packed forward as the unpacked one."""
    from tests.helpers.reference import lora_model

    rng = np.random.default_rng(8)
    samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=2)
    row = pack_samples(samples)
    targets = ("in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj", "q_proj", "down_proj")
    model = lora_model(hybrid_model("qwen3_5", seed=2), seed=8, targets=targets)
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_grads = _reference(model, samples, weights)
    lp, grads = _packed(model, row, weights, 4)
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    lora = [n for n in grads if "lora_" in n]
    assert any("in_proj_qkv" in n for n in lora) and any("linear_attn.out_proj" in n for n in lora)
    for name in lora:
        assert (grads[name] - ref_grads[name]).abs().max().item() <= 1e-4, name


def test_ordinary_forward_is_untouched_after_install():
    """Without a plan (generation, evaluation) the wrapped layers run transformers' own forward."""
    model = hybrid_model("qwen3_5").eval()
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
        use_tree_attention(model)
        got = model(input_ids=ids, use_cache=False).logits
        greedy = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, ref)
    assert greedy.shape == (1, 16)


def _recurrent_reference(q, k, v, g, beta):
    """Token-by-token gated delta rule on one path (the definition): fp32, grouped heads, L2-normed q/k."""
    h_v = v.shape[1]
    q, k = (t.repeat_interleave(h_v // t.shape[1], dim=1).float() for t in (q, k))
    q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12) * q.shape[-1] ** -0.5
    k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    state = torch.zeros(h_v, q.shape[-1], v.shape[-1])
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = (v[t] - torch.einsum("hk,hkv->hv", k[t], state)) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(out)


def test_kernels_follow_each_token_path():
    """Row-level check of both kernels against the per-token definition along each sample's own path."""
    rng = np.random.default_rng(9)
    samples = _deep_tree_samples(rng)
    row = pack_samples(samples)
    plan = build_linear_plan(row, chunk=5)
    n_tok = row.num_tokens
    q, k = torch.randn(n_tok, 2, 8), torch.randn(n_tok, 2, 8)
    v, g, beta = torch.randn(n_tok, 4, 6), -torch.rand(n_tok, 4), torch.rand(n_tok, 4)
    x, w = torch.randn(n_tok, 5), torch.randn(5, 4)
    out = tree_gated_delta_rule(q, k, v, g, beta, plan)
    conv = tree_causal_conv(x, w, None, plan)
    from asyncgrpo.packing.trie import PrefixTrie

    trie = PrefixTrie()
    for s in samples:
        trie.insert(s)
    for rows in trie.layout().sample_index:
        path = torch.from_numpy(rows)
        ref = _recurrent_reference(q[path], k[path], v[path], g[path], beta[path])
        assert (out[path] - ref).abs().max() <= 1e-4
        xp = torch.nn.functional.pad(x[path].T[None], (3, 0))
        ref_conv = torch.nn.functional.conv1d(xp, w[:, None, :], groups=5)[0].T
        assert (conv[path] - ref_conv).abs().max() <= 1e-5


def test_plan_refuses_a_fork_inside_a_parent_segment():
    """The delta rule hands a segment its parent's *final* state; a row that forks mid-segment is refused."""
    import dataclasses

    row = pack_samples(_deep_tree_samples(np.random.default_rng(1)))
    starts, ends, parents = row.seg_start.numpy(), row.seg_end.numpy(), row.seg_parent.numpy()
    child = next(s for s in range(len(starts)) if parents[s] >= 0 and ends[parents[s]] - starts[parents[s]] >= 2)
    parent = row.parent.clone()
    parent[starts[child]] = int(starts[parents[child]])  # now forks after the parent segment's first token
    with pytest.raises(ValueError, match="forks inside its parent segment"):
        build_linear_plan(dataclasses.replace(row, parent=parent))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_trie_path_survives_mode_switches_of_a_loaded_model(family, tmp_path):
    """The trainer's path: ``from_pretrained``, install, then ``train()``/``eval()`` (every step calls ``train()``).

    transformers 5.25 loads with hub kernels on and runs ``kernelize`` again at each mode change, which deletes
    instance-level ``forward`` attributes of ``@use_kernel_forward_from_hub`` layers (``Qwen3_5GatedDeltaNet``).
    A trie path kept there was dropped and packed rows ran the flat causal forward (4e-2 log-prob gap).
    """
    hybrid_model(family, seed=3).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    use_tree_attention(model)
    model.train()
    model.eval()
    model.train()
    rng = np.random.default_rng(9)
    samples = random_tree_samples(rng, vocab_size=VOCAB, num_groups=2)
    row = pack_samples(samples)
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32))
    ref_lp, ref_grads = _reference(model, samples, weights)
    lp, grads = _packed(model, row, weights, 4)
    assert (lp - ref_lp).abs().max().item() <= 1e-4
    for name, g in grads.items():
        assert (g - ref_grads[name]).abs().max().item() <= 1e-4, name


def test_packed_row_refuses_a_deltanet_layer_whose_forward_was_replaced():
    """An instance-level forward set after installation (a hub kernel, an offloading hook) would bypass the trie
    path silently; the decoder layer's wrapper names the layer instead."""
    import types

    model = hybrid_model("qwen3_5")
    use_tree_attention(model)
    layer = model.model.layers[1].linear_attn
    base = type(layer).__mro__[2]  # the transformers class under the trie-aware subclass
    assert base.__name__ == "Qwen3_5GatedDeltaNet"
    layer.forward = types.MethodType(base.forward, layer)  # what kernels' _replace_forward does with a hub kernel
    row = pack_samples(random_tree_samples(np.random.default_rng(1), vocab_size=VOCAB, num_groups=1))
    with pytest.raises(RuntimeError, match="Gated DeltaNet layer 1 .* without its trie path"):
        packed_hidden_states(model, row, build_plan(row, "sdpa", linear_attention=True))

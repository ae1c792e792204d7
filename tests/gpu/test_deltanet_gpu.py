"""Gated DeltaNet hybrids in the trie on CUDA (SPEC P6): packed == unpacked, fp32, with the trainer's CUDA backend.

Run: ``pytest -s -q tests/gpu/test_deltanet_gpu.py``; each case prints its max log-prob and gradient differences.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from asyncgrpo.packing.attention import build_plan, packed_hidden_states, use_tree_attention
from asyncgrpo.packing.row import pack_samples
from asyncgrpo.trainer.logprobs import selective_logprobs
from tests.helpers.reference import unpacked_logprobs_and_grads
from tests.helpers.synthetic import grpo_samples
from tests.unit.packing.test_packing_deltanet import VOCAB, _deep_tree_samples, hybrid_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_packed_hybrid_matches_unpacked_on_cuda(family, backend):
    rng = np.random.default_rng(4)
    # plus groups long enough for many 64-token chunks per segment
    samples = _deep_tree_samples(rng) + grpo_samples(2, 4, prompt_len=150, completion_len=(20, 200), vocab_size=VOCAB)
    row = pack_samples(samples).to("cuda")
    model = hybrid_model(family).cuda()
    weights = torch.from_numpy(rng.standard_normal(row.num_trained).astype(np.float32)).cuda()
    ref_lp, ref_grads = unpacked_logprobs_and_grads(model, samples, weights)
    use_tree_attention(model)
    model.zero_grad()
    hidden = packed_hidden_states(model, row, build_plan(row, backend, device="cuda", linear_attention=True))
    lp = selective_logprobs(hidden[row.pred_index], model.get_output_embeddings().weight, row.target_ids).logprobs
    (lp * weights).sum().backward()
    lp_diff = (lp.detach() - ref_lp).abs().max().item()
    grad_diff = max((p.grad - ref_grads[n]).abs().max().item() for n, p in model.named_parameters() if n in ref_grads)
    print("PARITY", json.dumps({"family": family, "backend": backend, "lp": lp_diff, "grad": grad_diff}))
    assert lp_diff <= 1e-4 and grad_diff <= 1e-4

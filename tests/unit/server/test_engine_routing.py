"""``enable_return_routed_experts`` in the engine (general path, CPU, fp32): each output's routing equals the
sorted top-k of transformers' own router logits over prompt + output minus the last token, whether the engine
decodes one step ahead or not and when a sequence is preempted and recomputed; ``routed_experts_prompt_start``
drops that many prompt rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.request import Request, SamplingParams
from tests.unit.server.test_engine_batching import Collector


@torch.no_grad()
def _reference(model, tokens: list[int]) -> np.ndarray:
    out = model(input_ids=torch.tensor([tokens]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    ids = [torch.topk(r.reshape(len(tokens), -1), k, dim=-1).indices for r in out.router_logits]
    return np.sort(torch.stack(ids, dim=1).numpy(), axis=-1)


@pytest.mark.parametrize("look_ahead", [True, False])
def test_routing_of_every_forwarded_token_under_preemption(look_ahead):
    model_dir = tiny_model_dir("olmoe")
    eng = Engine(model_dir, max_model_len=24, kv_cache_tokens=24, block_size=2, max_num_seqs=4,
                 enable_return_routed_experts=True)  # fmt: skip
    eng.look_ahead = look_ahead
    prompts = [[5, 17, 99, 3], [7] * 5, [11, 12, 13], [300, 301]]
    eng.start()
    try:
        col = Collector()
        for i, p in enumerate(prompts):
            params = SamplingParams(max_tokens=8, seed=i, routed_experts_prompt_start=i % 3)
            eng.submit(Request(f"p{i}", p, params), col)
        outs = col.wait([f"p{i}" for i in range(4)])
        assert eng.stats().num_preemptions_total > 0
    finally:
        eng.shutdown()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i, p in enumerate(prompts):
        out = outs[f"p{i}"]
        routed = out.routed_experts
        assert routed.dtype == np.uint8 and routed.shape == (len(p) + len(out.token_ids) - 1 - i % 3, 2, 2)
        ref = _reference(model, p + out.token_ids[:-1])[i % 3 :]
        np.testing.assert_array_equal(np.sort(routed, axis=-1), ref)

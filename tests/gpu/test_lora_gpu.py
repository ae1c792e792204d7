"""Runtime LoRA on a GPU server: a PEFT adapter made in the test generates like the merged model.

Run on the GPU machine: ``python -m pytest -q -m gpu tests/gpu/test_lora_gpu.py``.
"""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.server.launcher import launch_server

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

PROMPT = [1, 504, 3032, 314, 260, 3241]
TOL = 1e-4
GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 3}


def _write_tiny_llama(path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def _base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _adapter(model_dir, out_dir, seed):
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                          "up_proj", "down_proj"], init_lora_weights=False)  # fmt: skip
    model = peft.get_peft_model(_base(model_dir), cfg)
    model.save_pretrained(out_dir)
    return model.merge_and_unload().eval()


def _check(reference, result):
    ids = PROMPT + result.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([ids[:-1]])).logits[0, len(PROMPT) - 1 :].double(), -1)
    assert result.token_ids == ref.argmax(-1).tolist()
    for i, t in enumerate(result.token_ids):
        assert abs(result.logprobs[i] - ref[i, t].item()) <= TOL
        for tok, v in result.top_logprobs[i].items():
            assert abs(v - ref[i, tok].item()) <= TOL


def test_lora_on_gpu_equals_merged_model(tmp_path):
    model_dir = _write_tiny_llama(tmp_path / "llama")
    merged = _adapter(model_dir, tmp_path / "a1", seed=1)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    with launch_server(model_dir, extra_args=["--device", "cuda:0", "--dtype", "float32", "--max-model-len", "64",
                                              "--enable-lora", "--max-lora-rank", "8"],
                       env={"CUDA_VISIBLE_DEVICES": visible}, timeout=300) as server:  # fmt: skip

        async def go():
            async with AsyncServerClient(server.base_url, retries=0) as c:
                await c.load_lora_adapter("a1", str(tmp_path / "a1"))
                lora, base = await asyncio.gather(c.generate(PROMPT, GREEDY, model="a1"), c.generate(PROMPT, GREEDY))
                await c.unload_lora_adapter("a1")
                return lora, base

        lora, base = asyncio.run(go())
    _check(merged, lora)
    _check(_base(model_dir), base)
    assert lora.token_ids != base.token_ids

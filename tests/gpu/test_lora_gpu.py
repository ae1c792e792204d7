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
from tests.helpers.reference import ALL_LINEAR, PROMPT, check_greedy, hf_model, make_lora_adapter, write_tiny_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "logprobs": 3}


def test_lora_on_gpu_equals_merged_model(tmp_path):
    model_dir = write_tiny_llama(tmp_path / "llama")
    merged = make_lora_adapter(model_dir, tmp_path / "a1", seed=1, rank=8, targets=ALL_LINEAR)
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
    check_greedy(merged, lora)
    check_greedy(hf_model(model_dir), base)
    assert lora.token_ids != base.token_ids

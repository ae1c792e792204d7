"""GPU diagnostic: engine decode logits vs HF per step, with the Triton kernel and with the torch path.

python bench/diag_decode.py   # prints one line per (config, path, step) with the max |diff|
"""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from asyncgrpo.inference.server import attention
from asyncgrpo.inference.server.kv_cache import KVCache
from asyncgrpo.inference.server.model import DecoderLM
from asyncgrpo.inference.server.request import Request, SamplingParams
from asyncgrpo.inference.server.runner import ModelRunner
from asyncgrpo.inference.server.scheduler import Sequence

CONFIGS = {
    "qwen3_d128": Qwen3Config(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=512,
        num_hidden_layers=2,
        vocab_size=4096,
    ),
    "llama_d16": LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
}


def run(name, cfg, triton_on, graphs, sync):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().to("cuda")
    attention.ENABLED["triton"] = triton_on
    model = DecoderLM(hf, 256)
    kv = KVCache(len(model.layers), 128, 16, model.num_kv_heads, model.head_dim, torch.float32, model.device)
    runner = ModelRunner(model, kv, max_num_seqs=8, max_model_len=256, use_graphs=graphs)
    runner.capture_graphs()
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 40, 17]
    free = list(range(kv.num_blocks))
    random.Random(0).shuffle(free)
    seqs = []
    for n in lengths:
        s = Sequence(Request("r", torch.randint(0, 4096, (n,), generator=gen).tolist(), SamplingParams(1)), print)
        s.block_table = [free.pop() for _ in range(16)]
        seqs.append(s)
    steps = [runner.prefill(seqs).float().clone()]
    for _ in range(6):
        for s in seqs:
            s.token_ids.append(int(torch.randint(0, 4096, (1,), generator=gen)))
        steps.append(runner.decode(seqs).float().clone())
        if sync:
            torch.cuda.synchronize()
    worst = []
    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([s.token_ids], device="cuda")).logits[0].float()
        worst.append([round((got[i] - ref[lengths[i] - 1 + k]).abs().max().item(), 5) for k, got in enumerate(steps)])
    print(
        f"{name:12s} triton={triton_on!s:5s} graphs={graphs!s:5s} sync={sync!s:5s} backend={runner.backend:20s}",
        worst,
        flush=True,
    )


if __name__ == "__main__":
    for name, cfg in CONFIGS.items():
        for triton_on, graphs, sync in [
            (False, False, True),
            (True, False, True),
            (True, True, True),
            (True, True, False),
        ]:
            try:
                run(name, cfg, triton_on, graphs, sync)
            except Exception as e:  # noqa: BLE001 - a diagnostic reports every failure and goes on
                print(name, triton_on, graphs, sync, "ERROR", repr(e)[:300], flush=True)

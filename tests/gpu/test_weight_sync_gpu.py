"""NCCL weight round trip: a real server on GPU 0 (subprocess), the trainer-side sender on GPU 1.

Run on a machine with 2 GPUs: ``python -m pytest -q -m gpu tests/gpu/test_weight_sync_gpu.py -s``.
The model is a tiny random-init Llama written in the test (no tokenizer, token-id prompts),
served in fp32 so the check against a CPU fp32 HF forward holds to 1e-4.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import torch

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.server.launcher import launch_server
from asyncgrpo.weights.sender import WeightSender

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

PROMPT = [1, 504, 3032, 314, 260, 3241]
TOL = 1e-4
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def write_tiny_llama(path, seed=0):
    """A random-init fp32 Llama (hidden 64, 2 layers, vocab 4096) saved without a tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=2, bos_token_id=1)  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    model_dir = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")
    server = launch_server(
        model_dir,
        extra_args=["--device", "cuda:0", "--dtype", "float32", "--max-model-len", "64",
                    "--weight-transfer-config", '{"backend": "nccl"}'],
        env={"CUDA_VISIBLE_DEVICES": visible[0], **NO_MULTICAST},
        timeout=300,
    )  # fmt: skip
    cpu_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sender = WeightSender(timeout_s=120, packed_buffer_size_bytes=256 * 1024)
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cuda:1")  # auto: the server says nccl
    yield server, cpu_model, sender
    sender.close()
    server.stop()


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


def _greedy(url):
    async def go():
        async with AsyncServerClient(url, retries=0) as c:
            sp = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "logprobs": 3}
            return await c.generate(PROMPT, sp), (await c.weight_info())["weight_version"]

    return asyncio.run(go())


def _check(model, result):
    ids = PROMPT + result.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0, len(PROMPT) - 1 :].double(), -1)
    assert result.token_ids == ref.argmax(-1).tolist()
    for i, t in enumerate(result.token_ids):
        assert abs(result.logprobs[i] - ref[i, t].item()) <= TOL
        for tok, v in result.top_logprobs[i].items():
            assert abs(v - ref[i, tok].item()) <= TOL


def test_nccl_rounds_unpacked_packed_and_bf16(setup):
    server, model, sender = setup
    assert sender.backend == "nccl"
    before, version = _greedy(server.base_url)
    _check(model, before)
    assert version == "0"

    _perturb(model, 1)
    on_gpu = [(n, p.detach().to("cuda:1")) for n, p in model.named_parameters()]
    sender.close()  # packing is fixed at init (vLLM's update_info has no packed field): form an unpacked group
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cuda:1", packed=False)
    t = sender.update(on_gpu, version="step-1")
    after, version = _greedy(server.base_url)
    assert version == "step-1" and after.token_ids != before.token_ids
    _check(model, after)
    print(f"\nunpacked round: {t}")

    _perturb(model, 2)
    sender.close()
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cuda:1", packed=True)
    t = sender.update([(n, p.detach().to("cuda:1")) for n, p in model.named_parameters()], version="step-2")
    result, version = _greedy(server.base_url)
    assert version == "step-2"
    _check(model, result)
    print(f"packed round (256 KiB chunks): {t}")

    _perturb(model, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    meta = [(n, torch.bfloat16, tuple(p.shape)) for n, p in model.named_parameters()]
    lazy = ((n, p.detach().to("cuda:1", torch.bfloat16)) for n, p in model.named_parameters())
    sender.update(lazy, version="step-3", metadata=meta)
    result, version = _greedy(server.base_url)
    assert version == "step-3"
    _check(model, result)


def test_nccl_broadcast_bandwidth(setup):
    """Time rounds of the same tensors (metadata reused) and report the achieved rate; no threshold."""
    server, model, sender = setup
    tensors = [(n, p.detach().to("cuda:1")) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    sender.update(tensors, version="warm")
    start = time.perf_counter()
    rounds = 5
    for i in range(rounds):
        sender.update(tensors, version=f"bw-{i}")
    dt = (time.perf_counter() - start) / rounds
    print(f"\n{nbytes / 2**20:.1f} MiB per round, {dt * 1e3:.1f} ms per full round (pause..resume)")
    assert _greedy(server.base_url)[1] == f"bw-{rounds - 1}"

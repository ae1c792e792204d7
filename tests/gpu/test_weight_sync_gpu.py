"""NCCL weight round trip: a real server on GPU 0 (subprocess), the trainer-side sender on GPU 1.

Run on a machine with 2 GPUs: ``python -m pytest -q -m gpu tests/gpu/test_weight_sync_gpu.py -s``.
The model is a tiny random-init Llama written in the test (no tokenizer, token-id prompts),
served in fp32 so the check against a CPU fp32 HF forward holds to 1e-4.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.server.launcher import launch_server
from asyncgrpo.weights.collectives import plan_chunks
from asyncgrpo.weights.policy import policy_weight_metadata
from asyncgrpo.weights.sender import WeightSender
from tests.helpers.reference import (
    ALL_LINEAR,
    check_greedy,
    hf_model,
    lora_model,
    perturb,
    server_greedy,
    write_tiny_llama,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
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
    cpu_model = hf_model(model_dir)
    sender = WeightSender(timeout_s=120, packed_buffer_size_bytes=256 * 1024)
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cuda:1")  # auto: the server says nccl
    yield server, cpu_model, sender, model_dir
    sender.close()
    server.stop()


def test_nccl_rounds_unpacked_packed_and_bf16(setup):
    server, model, sender, _ = setup
    assert sender.backend == "nccl"
    before, version = server_greedy(server.base_url)
    check_greedy(model, before)
    assert version == "0"

    perturb(model, 1)
    on_gpu = [(n, p.detach().to("cuda:1")) for n, p in model.named_parameters()]
    sender.close()  # packing is fixed at init (vLLM's update_info has no packed field): form an unpacked group
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cuda:1", packed=False)
    t = sender.update(on_gpu, version="step-1")
    after, version = server_greedy(server.base_url)
    assert version == "step-1" and after.token_ids != before.token_ids
    check_greedy(model, after)
    print(f"\nunpacked round: {t}")

    perturb(model, 2)
    sender.close()
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cuda:1", packed=True)
    t = sender.update([(n, p.detach().to("cuda:1")) for n, p in model.named_parameters()], version="step-2")
    result, version = server_greedy(server.base_url)
    assert version == "step-2"
    check_greedy(model, result)
    print(f"packed round (256 KiB chunks): {t}")

    perturb(model, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    meta = [(n, torch.bfloat16, tuple(p.shape)) for n, p in model.named_parameters()]
    lazy = ((n, p.detach().to("cuda:1", torch.bfloat16)) for n, p in model.named_parameters())
    sender.update(lazy, version="step-3", metadata=meta)
    result, version = server_greedy(server.base_url)
    assert version == "step-3"
    check_greedy(model, result)


def test_nccl_broadcast_bandwidth(setup):
    """Time rounds of the same tensors (metadata reused) and report the achieved rate; no threshold."""
    server, model, sender, _ = setup
    tensors = [(n, p.detach().to("cuda:1")) for n, p in model.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    sender.update(tensors, version="warm")
    start = time.perf_counter()
    rounds = 5
    for i in range(rounds):
        sender.update(tensors, version=f"bw-{i}")
    dt = (time.perf_counter() - start) / rounds
    print(f"\n{nbytes / 2**20:.1f} MiB per round, {dt * 1e3:.1f} ms per full round (pause..resume)")
    assert server_greedy(server.base_url)[1] == f"bw-{rounds - 1}"


def test_nccl_update_model_streams_a_peft_policy(setup):
    """The trainer's path: a LoRA policy on GPU 1 synced merged, one tensor at a time (CUDA allocator peak)."""
    server, _, sender, model_dir = setup
    policy = lora_model(hf_model(model_dir), seed=4, rank=8, targets=ALL_LINEAR).to("cuda:1")
    metas = policy_weight_metadata(policy)
    largest = max(m.nbytes for m in metas)
    # cuBLAS takes its workspace (32 MiB on Hopper) from the caching allocator at the first matmul on a stream:
    # allocate it before the baseline, so the peak measures the sync and not that one-off workspace.
    torch.ones(8, 8, device="cuda:1") @ torch.ones(8, 8, device="cuda:1")
    torch.cuda.synchronize("cuda:1")
    torch.cuda.reset_peak_memory_stats("cuda:1")
    base = torch.cuda.memory_allocated("cuda:1")
    sender.update_model(policy, version="peft-1")  # packed, 256 KiB chunks
    torch.cuda.synchronize("cuda:1")
    extra = torch.cuda.max_memory_allocated("cuda:1") - base
    # the merged tensor + PEFT's temporary, plus per buffer (double buffering overlaps packing and sending) one
    # chunk (<= buffer + one tensor) and one lone tensor in flight; the allocator rounds to 512 B
    nb = sender.packed_num_buffers
    bound = (2 + 2 * nb) * largest + nb * sender.packed_buffer_size_bytes + (1 << 16)
    print(f"\nupdate_model peak extra {extra / 2**20:.2f} MiB (bound {bound / 2**20:.2f} MiB)")
    assert extra <= bound
    result, version = server_greedy(server.base_url)
    assert version == "peft-1"
    check_greedy(policy.merge_and_unload().cpu().eval(), result)


def test_nccl_pipelined_small_buckets_twice_with_profiles(setup):
    """Packed in buckets smaller than the largest tensors, double-buffered on the side stream, two rounds in a row
    (the second reuses the first's buffers and views): the server serves each round's weights, and the profiled
    rounds report one broadcast per non-empty chunk on both ends."""
    server, model, sender, _ = setup
    metas = policy_weight_metadata(model)
    # one byte under the upper-quartile size: every tensor that large (layers repeat shapes) travels alone
    bucket = sorted(m.nbytes for m in metas)[len(metas) * 3 // 4] - 1
    chunks = plan_chunks(metas, bucket)
    assert sum(len(c) > 1 for c in chunks) >= 3 and sum(len(c) == 1 for c in chunks) >= 3
    # the module's sender, in a group formed again with this bucket (both ends leave the old group together)
    sender.close()
    sender.packed_buffer_size_bytes, sender.profile = bucket, True
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cuda:1", packed=True)
    ptrs = []
    for seed in (11, 12):
        perturb(model, seed)
        sender.update_model(model.to("cuda:1"), version=f"pipe-{seed}")
        model.to("cpu")
        result, version = server_greedy(server.base_url)
        assert version == f"pipe-{seed}"
        check_greedy(model, result)
        b = sender.last_breakdown
        print(f"\npipelined round {seed}: {b}")
        sent = len([c for c in chunks if sum(metas[i].nbytes for i in c)])
        assert b["sender_wire"]["broadcast_count"] == sent and b["sender_wire"]["wire_busy_ms"] > 0
        assert b["receiver"]["wire"]["broadcast_count"] == sent
        assert b["receiver"]["wire"]["unpack_count"] == sum(len(c) > 1 for c in chunks)
        ptrs.append([buf.data_ptr() for buf in sender._lanes.bufs])
    assert ptrs[0] == ptrs[1]  # the same chunk buffers in both rounds

"""CUDA IPC weight sync on one GPU: the embedded server and the trainer-side sender share GPU 0.

Run on a machine with a GPU: ``python -m pytest -q -s -m gpu tests/gpu/test_ipc_sync_gpu.py``.
After every round the server's greedy tokens and top-3 log-probs must equal a CPU fp32 HF forward of the
weights sent (1e-4): full model and PEFT (merged), packed and unpacked. The tiny random-init Llama is
served in fp32; its embedding and head are larger than the 256 KiB packed buffer, so a packed round has
both buffer chunks and tensors shared alone.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.multiprocessing.reductions import reduce_tensor

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import WeightTransferError
from asyncgrpo.server.launcher import launch_server
from asyncgrpo.weights.collectives import TensorMeta
from asyncgrpo.weights.ipc import INSECURE_ENV, device_uuid, encode_handles, plan_calls, update_body
from asyncgrpo.weights.policy import policy_weight_metadata
from asyncgrpo.weights.sender import WeightSender
from tests.helpers.raw_http import raw
from tests.helpers.reference import ALL_LINEAR, check_greedy, hf_model, lora_model, perturb, server_greedy
from tests.helpers.reference import write_tiny_llama as _write

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

BUFFER = 256 * 1024
SERVER_FLAGS = ["--device", "cuda:0", "--dtype", "float32", "--max-model-len", "64", "--kv-cache-tokens", "4096",
                "--enforce-eager"]  # fmt: skip


def _visible() -> str:
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = _write(tmp_path_factory.mktemp("tiny") / "llama")
    server = launch_server(model_dir, extra_args=SERVER_FLAGS, env={"CUDA_VISIBLE_DEVICES": _visible(),
                           INSECURE_ENV: "1"}, timeout=300)  # fmt: skip
    yield server, model_dir
    server.stop()


def _sender(url: str, packed: bool) -> WeightSender:
    sender = WeightSender(timeout_s=120, packed_buffer_size_bytes=BUFFER)
    sender.init(AsyncServerClient(url), backend="auto", device="cuda:0", packed=packed)
    return sender


def test_auto_picks_ipc_on_the_servers_gpu_and_nccl_is_refused(setup):
    server, _ = setup
    status, info = raw(server.base_url, "GET", "/server_info?config_format=json")
    assert status == 200 and info["asyncgrpo"]["gpu_uuid"] == device_uuid(0)
    assert info["asyncgrpo"]["weight_transfer_backends"] == ["nccl", "ipc"]
    sender = _sender(server.base_url, packed=True)
    assert sender.backend == "ipc"
    sender.close()
    with pytest.raises(ValueError, match="NCCL cannot put two ranks on one GPU: use 'ipc'"):
        WeightSender(timeout_s=30).init(AsyncServerClient(server.base_url), backend="nccl", device="cuda:0")


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_full_model_rounds_serve_the_sent_weights(setup, packed):
    server, model_dir = setup
    ref = hf_model(model_dir)  # CPU fp32 reference
    sender = _sender(server.base_url, packed)
    try:
        for seed in (1, 2):
            perturb(ref, seed + 10 * packed)
            on_gpu = copy.deepcopy(ref).to("cuda:0")  # the trainer's model: its parameters are shared where they lie
            sender.update(on_gpu.named_parameters(), version=f"full-{packed}-{seed}")
            metas = [TensorMeta(n, p.dtype, tuple(p.shape)) for n, p in on_gpu.named_parameters()]
            assert sender.last_breakdown["update_calls"] == len(plan_calls(metas, packed, BUFFER))
            result, version = server_greedy(server.base_url)
            assert version == f"full-{packed}-{seed}"
            check_greedy(ref, result)
        # tensors made on the fly (another dtype), announced up front: pulled one at a time
        perturb(ref, 3 + 10 * packed)
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        meta = [(n, torch.bfloat16, tuple(p.shape)) for n, p in ref.named_parameters()]
        lazy = ((n, p.detach().to("cuda:0", torch.bfloat16)) for n, p in ref.named_parameters())
        sender.update(lazy, version=f"bf16-{packed}", metadata=meta)
        result, version = server_greedy(server.base_url)
        assert version == f"bf16-{packed}"
        check_greedy(ref, result)
    finally:
        sender.close()


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_peft_policy_syncs_merged(setup, packed):
    """The trainer's path: ``update_model`` of a LoRA policy on the GPU; packed costs one merged tensor and the
    buffer, unpacked keeps the merged tensors until finish (vLLM's rule)."""
    server, model_dir = setup
    policy = lora_model(hf_model(model_dir), seed=4 + packed, rank=8, targets=ALL_LINEAR).to("cuda:0")
    metas = policy_weight_metadata(policy)
    largest = max(m.nbytes for m in metas)
    merged_total = sum(m.nbytes for m in metas if "proj" in m.name)
    torch.ones(8, 8, device="cuda:0") @ torch.ones(8, 8, device="cuda:0")  # cuBLAS workspace before the baseline
    sender = _sender(server.base_url, packed)
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sender.update_model(policy, version=f"peft-{packed}")
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
    finally:
        sender.close()
    bound = (2 * largest + BUFFER) if packed else (merged_total + 2 * largest)
    print(
        f"\nPEFT {'packed' if packed else 'unpacked'}: peak extra {extra / 2**20:.2f} MiB (bound {bound / 2**20:.2f})"
    )
    assert extra <= bound + (1 << 16)
    result, version = server_greedy(server.base_url)
    assert version == f"peft-{packed}"
    check_greedy(policy.merge_and_unload().cpu().eval(), result)


def test_handles_of_another_gpu_and_bad_sizes_are_refused_and_the_round_closes(setup):
    server, model_dir = setup
    url = server.base_url
    sender = _sender(url, packed=True)  # the server's transfer is now packed
    try:
        name, p = next(iter(hf_model(model_dir).named_parameters()))
        t = p.detach().to("cuda:0").reshape(-1).view(torch.uint8)
        meta = [TensorMeta(name, p.dtype, tuple(p.shape))]
        elsewhere = update_body(meta, encode_handles({"not-this-gpu": reduce_tensor(t)[1]}), packed=True)
        wrong_size = update_body(meta, encode_handles({device_uuid(0): reduce_tensor(t)[1]}), packed=True)
        wrong_size["tensor_sizes"] = [7]
        assert raw(url, "POST", "/pause?mode=keep")[0] == 200
        assert raw(url, "POST", "/start_weight_update")[0] == 200
        # vLLM 0.33 (v1/worker/gpu_worker.py): a worker error is a 500 and ends the round; the next update is
        # refused for that, whatever it carries, and so is the finish (tests/unit/server/test_ipc_refused_round.py)
        status, body = raw(url, "POST", "/update_weights", json={"update_info": elsewhere})
        assert status == 500 and "IPC handle not found for GPU UUID" in body["error"]["message"]
        status, body = raw(url, "POST", "/update_weights", json={"update_info": wrong_size})
        assert status == 500 and "start_weight_update must be called" in body["error"]["message"]
        assert raw(url, "POST", "/finish_weight_update", json={})[0] == 500
        assert raw(url, "POST", "/start_weight_update")[0] == 200  # the client's start/finish pair reopens it
        status, body = raw(url, "POST", "/update_weights", json={"update_info": wrong_size})
        assert status == 500 and "tensor_sizes" in body["error"]["message"]
        assert raw(url, "POST", "/start_weight_update")[0] == 200
        assert raw(url, "POST", "/finish_weight_update", json={})[0] == 200
        assert raw(url, "POST", "/resume")[0] == 200
        ref = hf_model(model_dir)
        perturb(ref, 21)
        sender.update(ref.to("cuda:0").named_parameters(), version="after-refusals")  # the sender still works
        result, version = server_greedy(url)
        assert version == "after-refusals"
        check_greedy(ref.cpu(), result)
    finally:
        sender.close()


def test_a_server_without_the_environment_switch_refuses_pickled_handles(tmp_path):
    model_dir = _write(tmp_path / "llama")
    with launch_server(model_dir, extra_args=SERVER_FLAGS, env={"CUDA_VISIBLE_DEVICES": _visible(),
                       INSECURE_ENV: "0"}, timeout=300) as server:  # fmt: skip
        before, version = server_greedy(server.base_url)
        sender = _sender(server.base_url, packed=False)
        assert sender.backend == "ipc"
        ref = hf_model(model_dir)
        perturb(ref, 31)
        with pytest.raises(WeightTransferError, match=f"{INSECURE_ENV}=1"):
            sender.update(ref.to("cuda:0").named_parameters(), version="never")
        sender.close()
        after, version_after = server_greedy(server.base_url)  # resumed, old weights, old version
        assert version_after == version and after.token_ids == before.token_ids

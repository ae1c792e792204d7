"""What an ipc round answers after a refused ``/update_weights``, without a GPU.

The reference is vLLM 0.33's worker (``v1/worker/gpu_worker.py: update_weights``): it checks that an update is
open *before* parsing ``IPCWeightTransferUpdateInfo`` (``distributed/weight_transfer/ipc_engine.py``), every error
inside is a 500 with the worker's message, and a failed update clears ``_weight_update_active``, so the next
update and the finish are refused for that (500), until a new start. ``--weight-transfer-checks strict`` refuses
bad input with a 400 and keeps the round open. The receiver is driven through its real steps on a stand-in engine
that claims ``cuda:0``: every refusal here happens before any CUDA call (the GPU test copies for real:
tests/gpu/test_ipc_sync_gpu.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncgrpo.server.engine import ipc_receiver
from asyncgrpo.server.engine.settings import ReceiverSettings
from asyncgrpo.server.engine.weight_receiver import WeightReceiver
from asyncgrpo.server.errors import ApiError
from asyncgrpo.weights.collectives import TensorMeta
from asyncgrpo.weights.ipc import INSECURE_ENV, encode_handles, update_body

THIS_GPU, OTHER_GPU = "GPU-aaaaaaaa-0000-1111-2222-333344445555", "GPU-ffffffff-0000-1111-2222-333344445555"


class _ClaimsCuda:
    """The members a receiver reads of its engine; it never runs a step (every refusal comes before one)."""

    device = torch.device("cuda", 0)
    weight_version = "0"

    def __init__(self) -> None:
        self.w = torch.zeros(4, 4)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "w", self.w

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"w": (4, 4)}

    def set_weight_version(self, version: str) -> None:
        self.weight_version = version

    def run_between_steps(self, fn, timeout=None):  # pragma: no cover - reached only by an accepted update
        raise AssertionError("a refused update must not reach the engine thread")


def _handle(uuid: str, nbytes: int) -> dict[str, tuple]:
    return {uuid: (torch.Tensor, torch.Size([nbytes]), (1,), 0, torch.UntypedStorage, torch.uint8, 0, b"\x01" * 64,
                   nbytes, 0, False, b"/torch_1_2", 7, b"\x02" * 64, True)}  # fmt: skip


@pytest.fixture
def receiver_for(monkeypatch):
    monkeypatch.setenv(INSECURE_ENV, "1")
    monkeypatch.setattr(ipc_receiver, "device_uuid", lambda index: THIS_GPU)

    def make(checks: str) -> WeightReceiver:
        receiver = WeightReceiver(_ClaimsCuda(), ReceiverSettings(backend="ipc", timeout_s=30, checks=checks))
        receiver.init({"packed": True})
        return receiver

    return make


META = [TensorMeta("w", torch.float32, (4, 4))]


def _bodies() -> tuple[dict, dict]:
    elsewhere = update_body(META, encode_handles(_handle(OTHER_GPU, 64)), packed=True)
    wrong_size = update_body(META, encode_handles(_handle(THIS_GPU, 64)), packed=True)
    wrong_size["tensor_sizes"] = [7]
    return elsewhere, wrong_size


def _refused(receiver: WeightReceiver, step: str, *args) -> ApiError:
    with pytest.raises(ApiError) as caught:
        getattr(receiver, step)(*args)
    return caught.value


def test_vllm_checks_a_refused_update_ends_the_round_and_a_new_start_reopens_it(receiver_for):
    receiver = receiver_for("vllm")
    elsewhere, wrong_size = _bodies()
    receiver.start()
    err = _refused(receiver, "update", elsewhere)
    assert err.status == 500 and "IPC handle not found for GPU UUID" in err.message
    # the round is over: the next update is refused for that, whatever it carries (the 409 of the bug)
    err = _refused(receiver, "update", wrong_size)
    assert err.status == 500 and "start_weight_update must be called before update_weights" in err.message
    assert _refused(receiver, "finish", None).status == 500
    # the client's rule (weights/round_control.py): a start/finish pair closes it; a fresh round works again
    receiver.start()
    err = _refused(receiver, "update", wrong_size)
    assert err.status == 500 and "tensor_sizes" in err.message
    receiver.start()
    assert receiver.finish("v1") == "v1" and receiver.active is False


def test_strict_checks_refuse_bad_input_with_400_and_keep_the_round_open(receiver_for):
    receiver = receiver_for("strict")
    elsewhere, wrong_size = _bodies()
    err = _refused(receiver, "update", elsewhere)  # no start yet: a state clash
    assert err.status == 409 and "start_weight_update" in err.message
    receiver.start()
    err = _refused(receiver, "update", elsewhere)
    assert err.status == 400 and "IPC handle not found for GPU UUID" in err.message
    err = _refused(receiver, "update", wrong_size)
    assert err.status == 400 and "tensor_sizes" in err.message
    assert receiver.active
    receiver.finish(None)
    assert not receiver.active

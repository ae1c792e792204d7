"""The TRL 1.16 plug-in adapters on their own: protocol checks, the worker host's grouping and health checks, the
metric conversion, and the weight-transfer deadline (real threads and queues; the training run is in
tests/integration/test_trl_compat_cpu.py)."""

from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest
import torch

from asyncgrpo.errors import WeightSyncTimeoutError, WeightTransferError
from asyncgrpo.trainer.trl_weights import (
    NamedTimeouts,
    TRLWeightTransferSync,
    call_within,
    check_weight_transfer_protocol,
)
from asyncgrpo.trainer.trl_worker import TRLWorkerHost, check_rollout_worker_protocol
from asyncgrpo.weights.base import WeightSync
from tests.helpers.trl_plugins import Sample


class Worker:
    def __init__(self) -> None:
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue()
        self.health_calls: list[float] = []
        self.versions: list[int] = []
        self.fail = False

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def update_model_version(self, model_version: int) -> None:
        self.versions.append(model_version)

    def check_health(self, stale_after_s: float) -> None:
        self.health_calls.append(stale_after_s)
        if self.fail:
            raise RuntimeError("worker child has failed")


def _sample(group: int, n: int, version: int = 0) -> Sample:
    return Sample([], [], np.arange(n), np.r_[np.zeros(2), np.ones(n - 2)], np.r_[np.zeros(2), -np.ones(n - 2)],
                  0.5 - group, version, group)  # fmt: skip


def test_missing_members_are_named():
    class NoHealth(Worker):
        check_health = None  # type: ignore[assignment]

    with pytest.raises(TypeError, match=r"rollout_worker=NoHealth has no method check_health\(\)"):
        check_rollout_worker_protocol(NoHealth())
    w = Worker()
    del w.rollout_buffer
    with pytest.raises(TypeError, match="has no attribute rollout_buffer"):
        check_rollout_worker_protocol(w)

    class Half:
        def init_weight_transfer(self): ...

        def pause(self): ...

    with pytest.raises(TypeError, match=r"weight_transfer=Half has no method send_weights\(\).*missing: send_weights, "
                                        "resume, destroy"):  # fmt: skip
        check_weight_transfer_protocol(Half())


def test_the_host_groups_samples_by_group_id_and_converts_them():
    w = Worker()
    host = TRLWorkerHost(w, stale_after_s=42.0, first_row=5)
    for s in (_sample(0, 4), _sample(0, 5, version=1), _sample(1, 3)):
        w.rollout_buffer.put(s)
    first = host.get_sample(1.0)
    assert (first.row_index, first.group_id, first.model_version, len(first.sequences)) == (5, 0, 0, 2)
    s = first.sequences[1]
    assert s.input_ids == [0, 1, 2, 3, 4] and s.loss_mask == [0, 0, 1, 1, 1]
    assert s.sampler_logprobs == [0.0, 0.0, -1.0, -1.0, -1.0] and s.advantage == 0.5 and s.model_version == 1
    assert first.tokens == 9
    second = host.get_sample(1.0)  # its first sample was read while gathering group 0
    assert (second.row_index, second.group_id, len(second.sequences)) == (6, 1, 1)
    host.set_policy_version(3)
    assert w.versions == [3]


def test_a_waiting_host_asks_check_health_and_surfaces_its_error():
    w = Worker()
    host = TRLWorkerHost(w, stale_after_s=42.0)
    with pytest.raises(TimeoutError, match="rollout_buffer"):
        host.get_sample(0.5)
    assert w.health_calls and set(w.health_calls) == {42.0}
    w.fail = True
    with pytest.raises(RuntimeError, match="worker child has failed"):
        host.get_sample(5.0)


def test_worker_metrics_become_weighted_events():
    w = Worker()
    w.metrics_queue.put({"rollout/gen_s": 2.0, "rollout/trunc_rate": (1.0, 4.0)})
    w.metrics_queue.put({"rollout/trunc_rate": (3.0, 4.0), "rollout/empty": (0.0, 0.0)})
    events = TRLWorkerHost(w, 1.0).drain_metrics()
    assert events == [("rollout/gen_s", 2.0, 1.0), ("rollout/trunc_rate", 0.25, 4.0), ("rollout/trunc_rate", 0.75, 4.0)]
    rate = sum(v * wt for n, v, wt in events if n == "rollout/trunc_rate") / 8.0
    assert rate == pytest.approx(4.0 / 8.0)  # the window's weighted mean is the summed ratio


def test_call_within_raises_naming_weight_sync_timeout_and_passes_errors_on():
    release = threading.Event()
    t0 = time.monotonic()
    with pytest.raises(
        WeightSyncTimeoutError, match=r"send_weights\(\) did not return within weight_sync_timeout=0.4s"
    ):
        call_within(release.wait, 0.4, "send_weights()")
    assert 0.4 <= time.monotonic() - t0 < 2.0
    release.set()
    with pytest.raises(ZeroDivisionError):
        call_within(lambda: 1 / 0, 1.0, "pause()")
    assert call_within(lambda: 7, 1.0, "resume()") == 7


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.received: dict[str, torch.Tensor] = {}

    def init_weight_transfer(self) -> None:
        self.calls.append("init")

    def pause(self) -> None:
        self.calls.append("pause")

    def send_weights(self, iterator) -> None:
        self.calls.append("send")
        self.received = {name: t.clone() for name, t in iterator}

    def resume(self) -> None:
        self.calls.append("resume")

    def destroy(self) -> None:
        self.calls.append("destroy")


def test_the_weight_sync_calls_the_protocol_in_trls_order():
    rec = Recorder()
    sync = TRLWeightTransferSync(rec, timeout_s=10.0)
    model = torch.nn.Linear(3, 2)
    metrics = sync.push(model, 0)
    sync.push(model, 1)
    sync.close()
    assert isinstance(sync, WeightSync)  # the trainer's seam (weights/base.py), every member there
    assert rec.calls == ["init", "pause", "send", "resume", "pause", "send", "resume", "destroy"]
    assert set(rec.received) == {"weight", "bias"} and torch.equal(rec.received["weight"], model.weight)
    assert set(metrics) == {"perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_barrier_s",
                            "perf/weight_sync_transfer_s"}  # fmt: skip


def test_our_senders_timeouts_are_named():
    class Stuck:
        backend, served_model = "gloo", None

        def push(self, model, step):
            raise WeightTransferError("timed out after 3s waiting for POST /start_weight_update")

        def close(self): ...

    class Broken(Stuck):
        def push(self, model, step):
            raise WeightTransferError("POST /update_weights failed: 500")

    with pytest.raises(WeightSyncTimeoutError, match=r"step 4 ran past weight_sync_timeout=3s: timed out after 3s"):
        NamedTimeouts(Stuck(), 3.0).push(None, 4)
    with pytest.raises(WeightTransferError, match="500") as info:
        NamedTimeouts(Broken(), 3.0).push(None, 4)
    assert not isinstance(info.value, WeightSyncTimeoutError)
    assert NamedTimeouts(Stuck(), 3.0).backend == "gloo" and isinstance(NamedTimeouts(Stuck(), 3.0), WeightSync)

"""The weight-transfer wire format over a real gloo group (two ranks on threads of this process)."""

from __future__ import annotations

import threading

import pytest
import torch

from asyncgrpo.errors import WeightTransferError
from asyncgrpo.weights.collectives import (
    TensorMeta,
    dtype_from_name,
    dtype_name,
    join_group,
    make_store,
    plan_chunks,
)
from asyncgrpo.weights.wire import receive_tensors, send_tensors


def _metas(sizes_bytes):
    return [TensorMeta(f"t{i}", torch.uint8, (n,)) for i, n in enumerate(sizes_bytes)]


def test_plan_chunks_closes_after_the_tensor_that_goes_over():
    # buffer 10 bytes: 4+4=8 (not over) +4=12 (over: close) | 20 (over: close) | 1+2 (rest)
    assert plan_chunks(_metas([4, 4, 4, 20, 1, 2]), 10) == [[0, 1, 2], [3], [4, 5]]
    # exactly reaching the size does not close the chunk (strictly over)
    assert plan_chunks(_metas([5, 5, 1]), 10) == [[0, 1, 2]]
    assert plan_chunks([], 10) == []
    with pytest.raises(ValueError, match="packed_buffer_size_bytes"):
        plan_chunks(_metas([1]), 0)


def test_dtype_names_round_trip():
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool):
        assert dtype_from_name(dtype_name(dt)) is dt
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match="not a torch dtype"):
        dtype_from_name("nn")


def _payload():
    g = torch.Generator().manual_seed(0)
    return [
        ("a.bf16", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: misaligns what follows
        ("b.f32", torch.randn(7, generator=g)),
        ("c.i64", torch.randint(-(2**40), 2**40, (3, 2), generator=g)),
        ("d.bool", torch.rand(5, generator=g) > 0.5),
        ("e.empty", torch.empty(0, 4)),
        ("f.scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("g.f16", torch.randn(2, 2, 2, generator=g).half()),
    ]


def _run_pair(sender, receiver):
    """Rank 0 on this thread, rank 1 on another; both join a fresh gloo group."""
    store0 = make_store("127.0.0.1", 0, rank=0, world_size=2, timeout_s=30)
    out = {}

    def rank1():
        try:
            store1 = make_store("127.0.0.1", store0.port, rank=1, world_size=2, timeout_s=30)
            group = join_group("gloo", rank=1, world_size=2, device="cpu", timeout_s=30, store=store1)
            out["received"] = receiver(group)
        except Exception as exc:  # noqa: BLE001 - surfaced by the assertion below
            out["error"] = exc

    t = threading.Thread(target=rank1)
    t.start()
    group0 = join_group("gloo", rank=0, world_size=2, device="cpu", timeout_s=30, store=store0)
    sender(group0)
    t.join(60)
    assert "error" not in out, out.get("error")
    return out["received"]


@pytest.mark.parametrize("packed,buffer", [(False, 0), (True, 1 << 20), (True, 16), (True, 1)])
def test_send_and_receive_round_trip(packed, buffer):
    payload = _payload()
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in payload]
    batches_seen = []

    def receiver(group):
        got = {}
        for batch in receive_tensors(group, metas, packed=packed, buffer_size_bytes=buffer or 1 << 30):
            batches_seen.append([n for n, _ in batch])
            got.update({n: t.clone() for n, t in batch})
        return got

    got = _run_pair(
        lambda g: send_tensors(g, (t for _, t in payload), metas, packed=packed, buffer_size_bytes=buffer or 1 << 30),
        receiver,
    )
    for name, expected in payload:
        assert got[name].dtype == expected.dtype and got[name].shape == expected.shape, name
        assert torch.equal(got[name], expected), name
    if packed:
        assert batches_seen == [[metas[i].name for i in c] for c in plan_chunks(metas, buffer)]
    else:
        assert len(batches_seen) == len(payload)


def test_sender_rejects_a_tensor_that_does_not_match_the_announced_metadata():
    metas = [TensorMeta("w", torch.float32, (2, 2))]

    def sender(group):
        with pytest.raises(WeightTransferError, match="announced"):
            send_tensors(group, [torch.zeros(3)], metas, packed=False)
        group.broadcast(torch.zeros(4))  # let the receiver finish

    got = _run_pair(sender, lambda g: [b for b in receive_tensors(g, metas, packed=False)])
    assert torch.equal(got[0][0][1], torch.zeros(2, 2))


def test_abort_check_cuts_a_wait_short():
    """A rank waiting on a broadcast that never comes gives up as soon as abort_check raises."""
    store0 = make_store("127.0.0.1", 0, rank=0, world_size=2, timeout_s=30)
    done = threading.Event()

    def rank1():
        store1 = make_store("127.0.0.1", store0.port, rank=1, world_size=2, timeout_s=30)
        # held until the test ends: a dropped group closes its connections, and rank 0's collective would then
        # fail with "connection closed by peer" instead of waiting for the abort check
        group1 = join_group("gloo", rank=1, world_size=2, device="cpu", timeout_s=30, store=store1)
        done.wait(30)
        del group1

    t = threading.Thread(target=rank1)
    t.start()
    group = join_group("gloo", rank=0, world_size=2, device="cpu", timeout_s=30, store=store0)
    calls = []

    def check():
        calls.append(1)
        if len(calls) > 3:
            raise WeightTransferError("server said no")

    group.abort_check = check
    with pytest.raises(WeightTransferError, match="server said no"):
        group.all_reduce_sum(torch.ones(1))  # rank 1 never joins this collective
    done.set()
    t.join(30)


def test_nccl_wire_view_keeps_the_bytes_and_fits_the_count(monkeypatch):
    """Huge chunks go out as int32/int64 views so NCCL's int element count suffices; bytes are unchanged."""
    from asyncgrpo.weights import collectives

    monkeypatch.setattr(collectives, "_NCCL_MAX_COUNT", 10)
    buf = torch.arange(24, dtype=torch.uint8)  # 24 bytes: int32 view has 6 elements
    wire = collectives._nccl_wire(buf)
    assert wire.dtype == torch.int32 and wire.numel() == 6
    assert torch.equal(wire.view(torch.uint8), buf) and wire.data_ptr() == buf.data_ptr()
    assert collectives._nccl_wire(torch.zeros(48, dtype=torch.uint8)).dtype == torch.int64  # 12 int32 > 10
    with pytest.raises(WeightTransferError, match="packed_buffer_size_bytes"):
        collectives._nccl_wire(torch.zeros(13, dtype=torch.uint8))  # no width divides 13 bytes
    assert collectives._nccl_wire(torch.zeros(2, dtype=torch.int16)).dtype == torch.uint8  # no NCCL int16


@pytest.mark.parametrize("packed,buffer", [(False, 0), (True, 40), (True, 1)])
def test_tensors_that_travel_alone_land_straight_in_their_destination(packed, buffer):
    """A receiver that names destinations gets lone tensors written into them (same storage, no staging); tensors
    packed with neighbours come back as views of the chunk for the caller to copy, as before."""
    payload = _payload()
    metas = [TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in payload]
    chunks = [[i] for i in range(len(metas))] if not packed else plan_chunks(metas, buffer)
    alone = {metas[c[0]].name for c in chunks if len(c) == 1}
    assert alone and (not packed or buffer == 1 or len(alone) < len(metas))
    dest = {n: torch.full_like(t, 7) if t.dtype != torch.bool else torch.zeros_like(t) for n, t in payload}
    dest["b.f32"] = torch.zeros(7, dtype=torch.float64)  # dtype differs: received in a staging tensor instead

    def receiver(group):
        in_place, got = set(), {}
        for batch in receive_tensors(group, metas, packed=packed, buffer_size_bytes=buffer or 1 << 30,
                                     destination=lambda m: dest.get(m.name)):  # fmt: skip
            for name, t in batch:
                if t.data_ptr() == dest[name].data_ptr() and t.numel():
                    in_place.add(name)
                else:
                    got[name] = t.clone()
        return in_place, got

    in_place, got = _run_pair(
        lambda g: send_tensors(g, (t for _, t in payload), metas, packed=packed, buffer_size_bytes=buffer or 1 << 30),
        receiver,
    )
    expected_in_place = {n for n in alone if n != "b.f32" and dict(payload)[n].numel()}
    assert in_place == expected_in_place
    for name, value in payload:
        target = dest[name] if name in in_place else got[name]
        assert torch.equal(target, value), name
    assert torch.equal(dest["b.f32"], torch.zeros(7, dtype=torch.float64))  # untouched

"""The weight-sync timeline summary (``weights/wire_profile.py``) against figures worked out by hand."""

from __future__ import annotations

import pytest
import torch

from asyncgrpo.weights.wire_profile import WireProfile, profiling_requested


def test_summary_of_overlapping_broadcasts_packs_and_unpacks():
    prof = WireProfile(torch.device("cpu"))  # off CUDA the marks are wall-clock seconds
    prof._begin, prof._end = 100.0, 100.010
    for kind, start, end in [("pack", 0.0, 0.001), ("broadcast", 0.001, 0.003), ("broadcast", 0.0025, 0.004),
                             ("broadcast", 0.006, 0.008), ("unpack", 0.008, 0.0095)]:  # fmt: skip
        prof.add(kind, 100.0 + start, 100.0 + end)
    got = prof.summary()
    # by hand: the wire runs over [1, 4] and [6, 8] ms: busy 3 + 2, idle 2 between 1 and 8
    want = {"span_ms": 10.0, "broadcast_ms": 2.0 + 1.5 + 2.0, "broadcast_count": 3.0, "pack_ms": 1.0,
            "pack_count": 1.0, "unpack_ms": 1.5, "unpack_count": 1.0, "wire_busy_ms": 5.0, "wire_gaps_ms": 2.0,
            "fill_ms": 1.0, "drain_ms": 2.0}  # fmt: skip
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-6), key


def test_no_summary_before_the_round_ends_and_the_switch(monkeypatch):
    assert WireProfile(torch.device("cpu")).summary() == {}
    monkeypatch.setenv("ASYNCGRPO_WEIGHT_SYNC_PROFILE", "1")
    assert profiling_requested()
    monkeypatch.setenv("ASYNCGRPO_WEIGHT_SYNC_PROFILE", "0")
    assert not profiling_requested()

"""The start clock's phases and their parts, on a clock the test moves by hand."""

from __future__ import annotations

import pytest

from asyncgrpo.server import start_clock
from asyncgrpo.server.start_clock import StartClock


@pytest.fixture
def now(monkeypatch):
    t = [100.0]
    monkeypatch.setattr(start_clock.time, "monotonic", lambda: t[0])
    return t


def test_parts_tile_their_phase_and_the_rest_is_other(now):
    clock = StartClock(from_process=False)
    now[0] += 0.5
    clock.mark("process")  # a phase without parts has none
    now[0] += 1.25
    clock.part("config")
    now[0] += 2.0
    clock.part("weights")
    now[0] += 0.25
    clock.mark("load")  # 0.25 s after the last part: "other"
    now[0] += 0.125
    clock.mark("kv")
    assert clock.phases == {"process": 0.5, "load": 3.5, "kv": 0.125}
    assert clock.parts == {"load": {"config": 1.25, "weights": 2.0, "other": 0.25}}
    assert clock.text() == "process 0.5 s, load 3.5 s [config 1.2, weights 2.0, other 0.2], kv 0.1 s"


def test_a_repeated_part_or_phase_adds_up_and_small_parts_stay_off_the_line(now):
    clock = StartClock(from_process=False)
    now[0] += 1.0
    clock.part("a")
    now[0] += 0.01
    clock.part("tiny")
    clock.mark("p")  # nothing after the last part: other is 0 and not printed
    now[0] += 2.0
    clock.part("a")
    clock.mark("p")
    assert clock.phases == {"p": 3.01}
    assert clock.parts == {"p": {"a": 3.0, "tiny": 0.01, "other": 0.0}}
    assert clock.text() == "p 3.0 s [a 3.0]"

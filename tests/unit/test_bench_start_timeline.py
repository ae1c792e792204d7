"""bench/probes/start_timeline.py: every start phase it times exists in this checkout, and a wrapped phase
records its first call only."""

from __future__ import annotations

import time

from bench.probes import start_timeline


def test_every_phase_resolves_in_this_checkout():
    """A renamed function would drop its phase from the time-to-learning JSON without a word (an older ``src`` is
    allowed to lack some; this one must have them all)."""
    missing = [(m, p) for m, p, _ in start_timeline.PHASES if start_timeline.resolve(m, p) is None]
    assert missing == []


def test_a_wrapped_function_records_its_first_call_and_passes_everything_through():
    calls: list[tuple] = []

    def work(*args, **kwargs):
        calls.append((args, kwargs))
        time.sleep(0.01)
        return len(calls)

    seen: dict[str, list[float]] = {}
    wrapped = start_timeline._first_call(work, "work", seen, time.time())
    assert wrapped(1, k=2) == 1
    first = list(seen["work"])
    assert wrapped(3) == 2
    assert calls == [((1,), {"k": 2}), ((3,), {})]
    assert seen["work"] == first and 0 <= first[0] < first[1]  # the first call's span; the second changed nothing
    assert start_timeline.resolve("types", "SimpleNamespace.__init__") is not None
    assert start_timeline.resolve("types", "NoSuchThing.f") is None

"""What a checkpoint's prompt-pools state must satisfy, from its own ``rollout_state.json`` (issue 36)."""

from __future__ import annotations


def check_pools_state(state: dict) -> None:
    """The pools learnt every settled draw, in draw order, exactly ``lag`` draws behind the first without a result.

    ``state`` is a checkpoint's ``rollout_state.json``. Draws below ``applied`` are learnt (one group each when
    every one was scored); those at or past it are held as results: every settled draw past ``applied``, and no
    draw the checkpoint left unsettled (it is generated again on resume, and learnt then).
    """
    pools, first = state["pools"], state["first_untrained_prompt"]
    settled = {int(f) for f in state["settled"]}
    applied, held = pools["applied"], {int(d) for d in pools["results"]}
    assert held == {d for d in range(applied, first)} | {f for f in settled if f >= applied}, (applied, first)
    first_unknown = applied
    while first_unknown in held:
        first_unknown += 1
    assert applied == max(first_unknown - pools["lag"], 0)
    assert sum(pools["groups"].values()) <= applied  # one group per scored draw learnt
    assert set(pools["rate"]) == set(pools["groups"])
    assert all(0.0 <= r <= 1.0 for r in pools["rate"].values())
    assert set(pools["retired"]).isdisjoint(int(p) for p in pools["parked"])

"""Reward functions importable by path from a YAML (``tests.helpers.rewards:even_token_reward``).

A tiny random-init model cannot solve a task, so these score the tokens themselves: groups get reward
variance and are trained, and a test can recompute a score from the completion ids alone.
"""

from __future__ import annotations

from typing import Any


def even_token_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Fraction of even token ids in each completion (0.0 for an empty one)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def append_record(entry: dict[str, Any]) -> None:
    """One JSON line appended to ``$ASYNCGRPO_TEST_RECORD`` (the spawned worker inherits the variable)."""
    import json
    import os

    with open(os.environ["ASYNCGRPO_TEST_RECORD"], "a") as fh:
        fh.write(json.dumps(entry) + "\n")


def recording_reward(completion_ids: list[list[int]], row: list[int], **kwargs: Any) -> list[float]:
    """``even_token_reward``, and one record per scored group: the dataset column ``row`` and the group's
    completion ids (tests compare them with requests of their own)."""
    append_record({"row": row[0], "completion_ids": completion_ids})
    return even_token_reward(completion_ids)


def half_constant_reward(completion_ids: list[list[int]], idx: list[int], **kwargs: Any) -> list[float]:
    """1.0 for every completion of an even dataset row (a tied group: no signal), ``even_token_reward`` for an odd
    row; one record per scored group (``row``, ``rewards``) when ``$ASYNCGRPO_TEST_RECORD`` is set."""
    import os

    rewards = [1.0] * len(completion_ids) if idx[0] % 2 == 0 else even_token_reward(completion_ids)
    if os.environ.get("ASYNCGRPO_TEST_RECORD"):
        append_record({"row": idx[0], "rewards": rewards})
    return rewards

"""Reward functions importable by path from a YAML (``tests.helpers.rewards:even_token_reward``).

A tiny random-init model cannot solve a task, so these score the tokens themselves: groups get reward
variance and are trained, and a test can recompute a score from the completion ids alone.
"""

from __future__ import annotations

from typing import Any


def even_token_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """Fraction of even token ids in each completion (0.0 for an empty one)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]

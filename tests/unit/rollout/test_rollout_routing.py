"""Routing in the rollout (``rollout/routing.py``): a later turn asks only for the rows its rollout lacks, a fork
asks for all, rollouts in their own tasks do not see each other's turns, and reconciliation lays each turn's rows
at their positions (tool tokens from the next turn's prefill, the last sampled token without)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from asyncgrpo.rollout import routing
from asyncgrpo.rollout.reconcile import rollout_to_sequences
from asyncgrpo.types import Rollout, RoutedTurn


def _answer(prompt: list[int], output: list[int], start: int, layers: int = 2, k: int = 2):
    """An answer as the server builds it: one row per token from ``start`` to the last output token, excluded;
    row values encode the position (position % 200), so the test can tell where each row landed."""
    n = len(prompt) + len(output) - 1 - start
    rows = np.repeat(((np.arange(start, start + n) % 200)[:, None, None]), layers, 1).repeat(k, 2).astype(np.uint8)
    return SimpleNamespace(token_ids=output, routed_experts=rows)


def _turn(prompt, output, start):
    res = _answer(prompt, output, start)
    return RoutedTurn(prompt, output, [-0.1] * len(output), **routing.turn_routing(prompt, res))


def test_turns_ask_for_new_rows_and_reconciliation_places_them():
    async def episode():
        p1 = [1, 2, 3, 4]
        assert routing.prompt_start(p1) == 0
        t1 = _turn(p1, [5, 6, 7], 0)
        p2 = p1 + [5, 6, 7] + [8, 9]  # a tool result after the first answer
        start = routing.prompt_start(p2)
        assert start == len(p1) + 3 - 1  # the last sampled token is the first row to fetch
        t2 = _turn(p2, [10, 11], start)
        forked = [1, 2, 99]  # a re-rendered history: every row again
        assert routing.prompt_start(forked) == 0
        return t1, t2

    t1, t2 = asyncio.run(episode())
    (seq,) = rollout_to_sequences(Rollout([], [], [t1, t2]), group_id=0, row_index=0, model_version=0,
                                  num_sampler_logprobs=None)  # fmt: skip
    seq.validate()
    assert seq.routed_experts.dtype == np.int16 and seq.routed_experts.shape == (11, 2, 2)
    np.testing.assert_array_equal(seq.routed_experts[:-1, 0, 0], np.arange(10))  # every row at its position
    assert (seq.routed_experts[-1] == -1).all()  # the last sampled token was never forwarded


def test_rollouts_in_their_own_tasks_do_not_share_turns():
    async def rollout(prompt):
        first = routing.prompt_start(prompt)
        routing.turn_routing(prompt, _answer(prompt, [50], 0))
        await asyncio.sleep(0)
        return first, routing.prompt_start(prompt + [50, 60])

    async def group():
        return await asyncio.gather(rollout([1, 2]), rollout([3, 4, 5]))

    assert asyncio.run(group()) == [(0, 2), (0, 3)]


def test_a_server_without_routing_is_named():
    with pytest.raises(RuntimeError, match="--enable-return-routed-experts"):
        routing.turn_routing([1], SimpleNamespace(token_ids=[2], routed_experts=None))

"""The loop's helper names from before the requester (issue 40) still work, each with a deprecation warning, and do
what they did: the request seed of the formula in ``requests.py``, the answer as a turn, the turn as a rollout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.requests import Requester
from asyncgrpo.rollout.sampling import SamplingSettings
from asyncgrpo.rollout.settings import RolloutSettings


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "<" + " ".join(map(str, ids)) + ">"


def test_old_helper_names_warn_and_do_what_they_did():
    settings = RolloutSettings(model_name=None, sampling=SamplingSettings("http://127.0.0.1:1", 64, 4),
                               num_generations=2, max_staleness=1, seed=5, max_concurrent_rollouts=2,
                               initial_tokens_per_step=1)  # fmt: skip
    loop = AsyncRolloutLoop(settings, [], [], _Tok())
    loop.requester = Requester(settings, pool=None, policy_version=lambda: 0)  # what run() wires (no request here)
    with pytest.warns(DeprecationWarning, match="_next_seed"):
        first, second = loop._next_seed(), loop._next_seed()
    assert (first, second) == (5 * 1_000_003 + 1, 5 * 1_000_003 + 2)  # run seed × 1,000,003 + request count
    answer = SimpleNamespace(token_ids=[3, 4], logprobs=[-0.5, -0.25], sampling_mask=None, top_logprobs=None,
                             finish_reason="length")  # fmt: skip
    with pytest.warns(DeprecationWarning, match="_turn"):
        turn = loop._turn([1, 2], answer)
    assert (turn.prompt_ids, turn.output_ids, turn.output_log_probs) == ([1, 2], [3, 4], [-0.5, -0.25])
    assert turn.finish_reason == "length"
    with pytest.warns(DeprecationWarning, match="_single_turn_rollout"):
        rollout = loop._single_turn_rollout(turn)
    assert rollout.completion == [{"role": "assistant", "content": "<3 4>"}]
    assert rollout.completion_ids == [3, 4] and rollout.turns == [turn]

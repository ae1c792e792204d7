"""The agent tests' tool model is checked, not hoped for (tests/helpers/agent_model.py, tool_model_check.py)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import agent_model


def test_an_undertrained_tool_model_is_caught_naming_the_transcripts():
    with pytest.raises(agent_model.ToolModelNotReady) as caught:
        agent_model.warm_up_checked(rounds=[(2, 1e-2)], extra_rounds=0)
    message = str(caught.value)
    for user in ("Divide 8 by 2.", agent_model.FORK_PROMPT, agent_model.SLOW_PROMPT, "Keep multiplying 2 by 2."):
        assert f"{user!r} turn 1: " in message, message[:2000]


@pytest.mark.parametrize(
    "name, value",
    [("FIXTURE_VERSION", 999), ("WARMUP_ROUNDS", ((7, 0.5),)), ("EXTRA_ROUND", (1, 1e-3)), ("EXTRA_ROUNDS", 0)],
)
def test_the_cache_key_covers_the_fixture_version_and_the_warm_up_settings(monkeypatch, name, value):
    before = agent_model._cache_key()
    monkeypatch.setattr(agent_model, name, value)
    assert agent_model._cache_key() != before


def test_the_cache_key_covers_the_torch_version(monkeypatch):
    before = agent_model._cache_key()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert agent_model._cache_key() != before

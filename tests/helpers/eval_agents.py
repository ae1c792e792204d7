"""A scripted tool environment and rollout loop for the agent eval tests (importable by path from a YAML).

``EchoEnv`` records, in this process, every ``reset``, tool call and ``get_reward``; an evaluation runs its
episodes in the evaluating process, so a test reads these lists directly. ``ScriptedCallLoop`` sends every turn to
the server as training does and, when the episode has tools, replaces the sampled text with a call of ``echo``
carrying the first token the server sampled: a random-init model never writes a ``<tool_call>`` block itself, and
this keeps the server's sampling (and its randomness) in what the environment sees.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.types import TurnRecord

CALLS: list[dict[str, Any]] = []  # one entry per echo() call: the row's answer, the token, the pid
REWARDS: list[dict[str, Any]] = []  # one entry per get_reward(): the row's answer, the reward, the calls made
TURNS: list[int] = []  # prompt length of every turn ScriptedCallLoop sent while tools were on


def clear() -> None:
    CALLS.clear(), REWARDS.clear(), TURNS.clear()


def echo_reward(answer: str, tokens: list[int]) -> float:
    """1.0 when the answer plus the first echoed token (0 without a call) is even."""
    return 1.0 if (int(answer) + (tokens[0] if tokens else 0)) % 2 == 0 else 0.0


class EchoEnv:
    """One episode per row (``answer`` column); one tool, ``echo``."""

    def reset(self, answer: str, **kwargs: Any) -> None:
        self.answer, self.tokens = answer, []

    def echo(self, token: int) -> str:
        """Echo a token id back.

        Args:
            token: The token id.

        Returns:
            The token id, as text.
        """
        self.tokens.append(token)
        CALLS.append({"answer": self.answer, "token": token, "pid": os.getpid()})
        return f"ECHO {token}"

    def get_reward(self) -> float:
        reward = echo_reward(self.answer, self.tokens)
        REWARDS.append({"answer": self.answer, "reward": reward, "calls": len(self.tokens)})
        return reward


class NoReset:
    """An environment without ``reset``: the set that names it must be refused."""

    def echo(self, token: int) -> str:
        """Echo.

        Args:
            token: The token id.

        Returns:
            The token id, as text.
        """
        return str(token)


class ScriptedCallLoop(AsyncRolloutLoop):
    """The default loop whose turns, in an episode with tools, always call ``echo`` (see the module docstring)."""

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        turn = await super().generate_one_turn(prompt_ids)  # a real request to the server
        if not self.agents.has_tools:
            return turn
        TURNS.append(len(prompt_ids))
        first = turn.output_ids[0] if turn.output_ids else 0
        text = '<tool_call>\n{"name": "echo", "arguments": {"token": ' + str(first) + "}}\n</tool_call>"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return dataclasses.replace(turn, output_ids=ids, output_log_probs=[0.0] * len(ids), finish_reason="stop")

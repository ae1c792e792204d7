"""The reference's two-environment example (A4 in docs/spec.md): a dict of factories routed by the dataset's
``environment`` column.

``RecordingLoop`` only records which tools each rollout was given (what the chat template shows the model).
"""

from __future__ import annotations

import random

from datasets import Dataset

from asyncgrpo import AsyncGRPOTrainer, AsyncRolloutLoop
from tests.helpers.agent_examples.common import MODEL, config, record


class CodingEnv:
    def reset(self, **kwargs) -> str:
        record(env="coding", reset_kwargs=sorted(kwargs))
        n = random.randint(1, 20)
        return f"Compute the {n}th Fibonacci number."

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        return "42"


class GameEnv:
    def reset(self, **kwargs) -> str:
        record(env="game", reset_kwargs=sorted(kwargs))
        return "Reach the goal tile."

    def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        return "goal" if action == "up" else "wall"


def reward_func(prompts, completions, environment, **kwargs):
    for p, c, env in zip(prompts, completions, environment):
        record(env=env, prompt=p[-1]["content"], completion=c)
    return [1.0 if c and c[-1]["content"].strip() == "Done." else 0.0 for c in completions]


class RecordingLoop(AsyncRolloutLoop):
    async def generate_one(self, prompt, tools, group_id=0):
        record(shown_tools=[t.__name__ for t in tools], prompt=prompt[-1]["content"])
        return await super().generate_one(prompt, tools, group_id)


class RecordingTrainer(AsyncGRPOTrainer):
    loop_cls = RecordingLoop


# The dataset only routes: each row picks the environment for that rollout
if __name__ == "__main__":
    dataset = Dataset.from_dict({"environment": ["coding", "game"] * 4})

    trainer = RecordingTrainer(
        model=MODEL,
        args=config(max_steps=2),
        train_dataset=dataset,
        reward_funcs=reward_func,
        environment_factory={"coding": CodingEnv, "game": GameEnv},
    )
    trainer.train()

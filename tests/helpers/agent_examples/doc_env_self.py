"""The reference's self-sampling ``IncrementEnv`` (A4 in docs/spec.md): no train_dataset, ``reset()`` makes the
task, ``max_steps``."""

from __future__ import annotations

import random

from asyncgrpo import AsyncGRPOTrainer
from tests.helpers.agent_examples.common import MODEL, config, record


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        self.episodes = getattr(self, "episodes", 0) + 1
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        record(instance=id(self), episodes=self.episodes, target=self.target, counter=self.counter, kwargs=None)
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


if __name__ == "__main__":
    trainer = AsyncGRPOTrainer(
        model=MODEL,
        args=config(max_steps=2, max_concurrent_rollouts=4),
        environment_factory=IncrementEnv,
    )
    trainer.train()

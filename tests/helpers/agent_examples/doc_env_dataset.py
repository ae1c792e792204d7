"""The reference's ``IncrementEnv`` (A4 in docs/spec.md) with an external dataset: the ``target`` column reaches
``reset(target=...)``, and a trainer-owned ``format_reward`` sums with the environment's ``get_reward``."""

from __future__ import annotations

from datasets import Dataset

from asyncgrpo import AsyncGRPOTrainer
from tests.helpers.agent_examples.common import MODEL, config, record

# Each row carries the prompt and the task data (here, the counter target to reach).
dataset = Dataset.from_dict(
    {
        "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
        "target": list(range(1, 7)),
    }
)


class IncrementEnv:
    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target
        record(reset_target=target, prompt=kwargs["prompt"][-1]["content"], columns=sorted(kwargs))

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:  # exposed as a tool
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def format_reward(completions, **kwargs):  # trainer-owned: scores the completion text
    return [
        0.5 if c and c[-1]["role"] == "assistant" and c[-1]["content"].strip() == "Done." else 0.0 for c in completions
    ]


if __name__ == "__main__":
    trainer = AsyncGRPOTrainer(
        model=MODEL,
        args=config(max_steps=2),
        train_dataset=dataset,  # the dataset owns the task; the "target" column reaches reset(target=...)
        reward_funcs=format_reward,
        environment_factory=IncrementEnv,
    )
    trainer.train()

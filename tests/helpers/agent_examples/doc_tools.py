"""The reference's tools example (A1 in docs/spec.md): ``tools=[multiply, async_add]`` (plus an answer reward and
a tool-call cap)."""

from __future__ import annotations

from datasets import Dataset

from asyncgrpo import AsyncGRPOTrainer
from tests.helpers.agent_examples.common import MODEL, config, record

PROMPTS = ["Divide 8 by 2.", "Multiply 6 by nothing.", "Keep multiplying 2 by 2.", "Add 2 and 5."]


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def done_reward(prompts, completions, **kwargs):
    for p, c in zip(prompts, completions):
        record(prompt=p[-1]["content"], completion=c)
    return [
        float(bool(c) and c[-1]["role"] == "assistant" and c[-1]["content"].strip() == "Done.") for c in completions
    ]


if __name__ == "__main__":
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS]})
    trainer = AsyncGRPOTrainer(
        model=MODEL,
        reward_funcs=done_reward,
        args=config(max_steps=3, max_tool_calling_iterations=2),
        train_dataset=dataset,
        tools=[multiply, async_add],
    )
    trainer.train()

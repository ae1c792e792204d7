"""Trainer inputs checked at construction: tools, environments (A1, A4) and the training dataset.

Bad input fails here, in the user's process, with a message that says what to change, instead of in the
spawned rollout worker minutes later.
"""

from __future__ import annotations

from typing import Any

from asyncgrpo.models.vlm import check_no_images
from asyncgrpo.rollout.agents import (
    ENVIRONMENT_COLUMN,
    EnvironmentRows,
    check_environment_factory,
    check_tool,
    tool_names,
)

__all__ = ["check_dataset", "check_train_inputs"]


def _conversational(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)


def check_train_inputs(
    tools: Any, environment_factory: Any, train_dataset: Any, max_steps: int
) -> tuple[list[Any], dict[str, Any] | None, Any]:
    """Validate tools/environments (A1, A4) and the dataset; the environment owns the data without one."""
    if tools is not None and not isinstance(tools, (list, tuple)):
        raise TypeError(f"tools must be a list of functions, got {type(tools).__name__}")
    tools = list(tools or [])
    for t in tools:
        check_tool(t)
    tool_names(tools)
    factories = check_environment_factory(environment_factory) if environment_factory is not None else None
    if train_dataset is None:
        if factories is None:
            raise ValueError("train_dataset is required: a dataset with a conversational 'prompt' column")
        if list(factories) != [""]:
            raise ValueError(
                f"environment_factory is a dict {sorted(factories)}: pass a train_dataset whose "
                f"'{ENVIRONMENT_COLUMN}' column routes each rollout to one of them"
            )
        if max_steps <= 0:
            raise ValueError(
                "without a train_dataset the environment owns the data (reset() returns each prompt) and there "
                "are no epochs: set AsyncGRPOConfig(max_steps=...) to give the run a length"
            )
        return tools, factories, EnvironmentRows()
    check_dataset(train_dataset, factories)
    return tools, factories, train_dataset


def check_dataset(dataset: Any, factories: dict[str, Any] | None = None) -> None:
    if not hasattr(dataset, "__len__"):
        return  # iterable datasets are checked row by row by the worker
    if len(dataset) == 0:
        raise ValueError("train_dataset is empty")
    row = dataset[0]
    check_no_images(row, "train_dataset row 0")  # the worker checks every row again
    if factories is not None and list(factories) != [""] and row.get(ENVIRONMENT_COLUMN) not in factories:
        raise ValueError(
            f"train_dataset row 0 has {ENVIRONMENT_COLUMN}={row.get(ENVIRONMENT_COLUMN)!r}; with environment_factory "
            f"as a dict each row needs an '{ENVIRONMENT_COLUMN}' column naming one of {sorted(factories)}"
        )
    if factories is not None and "prompt" not in row:
        return  # each environment's reset() returns the prompt
    if "prompt" not in row:
        raise ValueError(f"train_dataset has columns {sorted(row)}; it needs a conversational 'prompt' column")
    if not _conversational(row["prompt"]):
        raise ValueError(
            f"train_dataset row 0 has prompt={row['prompt']!r}; prompts must be conversational: a list of "
            '{"role": "user", "content": "..."} messages'
        )

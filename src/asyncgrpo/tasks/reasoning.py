"""Ready tasks: reasoning-gym problem generators as conversational datasets, with their checker as reward.

reasoning-gym (PyPI) ships seeded generators (``chain_sum``, ``basic_arithmetic``,
``gsm_symbolic``, ...) and a ``score_answer`` checker for each, so a task needs
no download. The reward function is module-level (it is pickled into the
rollout worker) and rebuilds the checker from the task name in each row.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

SYSTEM_PROMPT = (
    "You are a careful math assistant. Think briefly, then give the final answer as a number inside "
    "<answer></answer>, for example <answer>42</answer>."
)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def reasoning_gym_dataset(
    task: str = "chain_sum",
    size: int = 256,
    seed: int = 0,
    system_prompt: str | None = SYSTEM_PROMPT,
    **task_config: Any,
):
    """A ``datasets.Dataset`` with columns ``prompt`` (messages), ``answer``, ``task`` and ``entry`` (JSON).

    Args:
        task: a reasoning-gym dataset name.
        size: number of problems.
        seed: generator seed (a different seed gives a held-out set).
        system_prompt: prepended as a system message (None: the user message alone).
        **task_config: the task's own settings (e.g. ``max_digits=2`` for ``chain_sum``).
    """
    import reasoning_gym
    from datasets import Dataset

    problems = reasoning_gym.create_dataset(task, size=size, seed=seed, **task_config)
    rows: dict[str, list[Any]] = {"prompt": [], "answer": [], "task": [], "entry": []}
    for entry in problems:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": entry["question"]})
        rows["prompt"].append(messages)
        rows["answer"].append(str(entry["answer"]))
        rows["task"].append(task)
        rows["entry"].append(json.dumps(entry, default=str))
    return Dataset.from_dict(rows)


@lru_cache(maxsize=32)
def _scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def extract_answer(text: str) -> str | None:
    """The content of the last ``<answer>`` tag, else the last number in the text, else None."""
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    assistant = [m.get("content") or "" for m in completion if m.get("role") == "assistant"]
    return assistant[-1] if assistant else ""


def reasoning_gym_reward(completions: list[Any], task: list[str], entry: list[str], **kwargs: Any) -> list[float]:
    """1.0 when reasoning-gym's checker accepts the extracted answer, else its partial score (often 0.0)."""
    out = []
    for completion, name, raw in zip(completions, task, entry):
        answer = extract_answer(_completion_text(completion))
        if answer is None:
            out.append(0.0)
            continue
        out.append(float(_scorer(name)(answer, json.loads(raw))))
    return out


def format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """0.1 for a completion whose last ``<answer></answer>`` tag holds a number: exactly the answers
    ``numeric_answer_reward`` reads from a tag (a small shaping bonus for prompts that ask for the tag).

    A model that never writes the tag gets no signal from it: SmolLM2-135M-Instruct wrote it in none of 480
    samples of the demo's prompts, so the demo leaves it out.
    """
    out = []
    for c in completions:
        tags = _ANSWER_TAG.findall(_completion_text(c))
        out.append(0.1 if tags and _NUMBER.fullmatch(tags[-1].strip()) else 0.0)
    return out


def numeric_answer_reward(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the answer equals the numeric ``answer`` column, else 0.0 (None: unparsable gold).

    The answer is the content of the last ``<answer>`` tag, or without a tag the last number of the completion
    (``extract_answer``): the tag is the preferred form, not a requirement (add ``format_reward`` to pay for it).
    """
    out: list[float | None] = []
    for completion, gold in zip(completions, answer):
        try:
            target = float(gold)
        except (TypeError, ValueError):
            out.append(None)
            continue
        got = extract_answer(_completion_text(completion))
        try:
            out.append(1.0 if got is not None and abs(float(got) - target) < 1e-9 else 0.0)
        except ValueError:
            out.append(0.0)
    return out


# maj@k in the evaluation harness compares the answers these rewards read (tasks/eval_metrics.answer_extractor).
reasoning_gym_reward.extract_answer = extract_answer  # type: ignore[attr-defined]
numeric_answer_reward.extract_answer = extract_answer  # type: ignore[attr-defined]

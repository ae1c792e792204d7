"""`accuracy_reward`: checks math answers against the dataset's `solution` column with math-verify (R6).

Requires `math-verify` (`pip install asyncgrpo[demo]` or `pip install math-verify`). Reward functions run in the
rollout worker's threads, where math-verify's signal-based timeouts cannot work, so timeouts are disabled off the
main thread (math-verify then warns once).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

logger = logging.getLogger(__name__)

# math-verify's own per-expression limit on the main thread (seconds).
_MAIN_THREAD_TIMEOUT_S = 5


def _completion_text(completion: Any) -> str:
    """Text of the answer: the last assistant message of a conversational completion (or a plain string)."""
    if isinstance(completion, str):
        return completion
    messages = [m for m in completion if m.get("role", "assistant") == "assistant"] or list(completion)
    if not messages:
        return ""
    content = messages[-1].get("content", "")
    if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def accuracy_reward(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when a completion's final answer is mathematically equal to the solution, else 0.0.

    The gold solution is parsed as LaTeX; when it cannot be parsed the example is skipped (`None`), so it counts as
    unscored rather than wrong. The completion's answer is extracted with `\\boxed{}` tried first.

    Args:
        completions: Completions in conversational format (lists of messages); the last assistant message is checked.
        solution: Raw-text gold solutions, one per completion (the dataset's `solution` column).
        **kwargs: Other reward inputs (prompts, completion_ids, dataset columns); unused.

    Returns:
        One of 1.0, 0.0 or None per completion.

    Example:
        >>> accuracy_reward([[{"role": "assistant", "content": r"So \\boxed{\\frac{1}{3}}"}]], [r"$\\frac{1}{3}$"])
        [1.0]
    """
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as exc:  # pragma: no cover - exercised only without the optional dependency
        raise ImportError("accuracy_reward needs math-verify: pip install math-verify") from exc

    if len(completions) != len(solution):
        raise ValueError(f"accuracy_reward got {len(completions)} completions but {len(solution)} solutions")
    timeout = _MAIN_THREAD_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    answer_config = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                basic_latex=True, units=True, malformed_operators=False, nits=False, boxed="all", equations=False
            ),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    rewards: list[float | None] = []
    for completion, gold_text in zip(completions, solution):
        gold = parse(gold_text, extraction_mode="first_match", parsing_timeout=timeout)
        if not gold:
            logger.debug("accuracy_reward: cannot parse gold solution %r; skipping the example", gold_text)
            rewards.append(None)
            continue
        answer = parse(
            _completion_text(completion),
            extraction_config=answer_config,
            extraction_mode="first_match",
            parsing_timeout=timeout,
        )
        rewards.append(float(verify(gold, answer, timeout_seconds=timeout)))
    return rewards

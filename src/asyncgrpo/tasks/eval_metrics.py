"""pass@k, mean@k and maj@k over n sampled completions per prompt (the evaluation harness, issue 36).

* **pass@k** is the unbiased estimator of Chen et al. (2021): with ``n`` samples of which ``c`` pass, the chance
  that ``k`` drawn without replacement hold at least one passing one, ``1 - C(n-c, k) / C(n, k)``. It uses all n
  samples, so n > k gives a lower-variance figure than drawing exactly k.
* **mean@k** is the mean total reward of a prompt's first ``k`` samples.
* **maj@k** takes the most frequent *answer* among the first ``k`` samples (ties: the one seen first) and scores
  the prompt with the reward of a sample giving it; it needs an answer per sample (``answer_extractor``) and is
  left out where answers cannot be compared.

A sample *passes* when its total reward is at least ``pass_threshold`` (1.0: the checkers' "correct").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 - C(n-c, k) / C(n, k)`` (1.0 once fewer than k samples fail)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # The product form of C(n-c, k) / C(n, k), which stays in floating point for large n.
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def majority_answer(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample giving the most frequent non-None answer (None when no sample has one)."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        if a is None:
            continue
        counts[a] = counts.get(a, 0) + 1
        first.setdefault(a, i)
    if not counts:
        return None
    best = max(counts, key=lambda a: (counts[a], -first[a]))  # most votes, then the earliest
    return first[best]


def report_ks(num_samples: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < num_samples:
        ks.append(k)
        k *= 2
    return [*ks, num_samples]


def set_metrics(
    rewards: Sequence[Sequence[float]],
    answers: Sequence[Sequence[str | None]] | None,
    pass_threshold: float = 1.0,
    ks: Sequence[int] | None = None,
) -> dict[str, float]:
    """``mean@k``, ``pass@k`` and (with answers) ``maj@k`` averaged over prompts, keyed without a prefix.

    Args:
        rewards: per prompt, the total reward of each of its n samples (NaN: unscored, counted as failing).
        answers: per prompt, each sample's extracted answer (None: none found), or None when not comparable.
        pass_threshold: a sample passes when its reward is at least this.
        ks: the k to report (default ``report_ks(n)``); every k must be <= n.
    """
    if not rewards:
        return {}
    n = min(len(r) for r in rewards)
    if n == 0 or any(len(r) != n for r in rewards):
        raise ValueError(
            f"every prompt needs the same number (>= 1) of samples, got {sorted({len(r) for r in rewards})}"
        )
    ks = list(ks) if ks is not None else report_ks(n)
    out: dict[str, float] = {}
    for k in ks:
        if not 1 <= k <= n:
            raise ValueError(f"k={k} needs 1 <= k <= num_samples={n}")
        means = [_nanmean(r[:k]) for r in rewards]
        out[f"mean@{k}"] = _nanmean(means)
        passes = [sum(1 for x in r if x >= pass_threshold) for r in rewards]  # NaN >= t is False
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in passes) / len(rewards)
        if answers is not None:
            scores = []
            for r, a in zip(rewards, answers):
                pick = majority_answer(a[:k])
                scores.append(1.0 if pick is not None and r[pick] >= pass_threshold else 0.0)
            out[f"maj@{k}"] = sum(scores) / len(scores)
    return out


def _nanmean(xs: Sequence[float]) -> float:
    kept = [x for x in xs if not math.isnan(x)]
    return sum(kept) / len(kept) if kept else math.nan


def answer_extractor(reward_funcs: Sequence[Any]) -> Callable[[str], str | None] | None:
    """The first reward function's ``extract_answer`` attribute (text -> answer or None), or None.

    A reward function that reads a final answer out of the text can expose how (``reasoning_gym_reward`` and
    ``numeric_answer_reward`` do), so maj@k compares exactly what the reward scored.
    """
    for func in reward_funcs:
        extract = getattr(func, "extract_answer", None)
        if callable(extract):
            return extract
    return None

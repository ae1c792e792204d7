"""The stand-in for the Trainer's train DataLoader: a step's batches come from the rollout source instead."""

from __future__ import annotations

import math
from typing import Any


class StepLoader:
    """Stands in for the train DataLoader: Trainer only needs its length and ``.dataset``.

    Batches come from ``get_batch_samples``, which ignores this iterator.
    """

    def __init__(self, dataset: Any, num_batches: int | None) -> None:
        self.dataset = dataset
        self._len = num_batches

    def __len__(self) -> int:
        if self._len is None:
            raise TypeError("length unknown: max_steps governs the run")
        return self._len

    def __iter__(self):
        while True:
            yield None


def step_loader_for(args: Any, dataset: Any) -> StepLoader:
    """The loader of a run: endless under ``max_steps``, else a bound on the steps of ``num_train_epochs``."""
    if args.max_steps > 0:
        return StepLoader(dataset, None)
    # Each step trains at least one whole prompt group except when a group spills over a step, so
    # 2 x prompts + a margin bounds the steps; the run stops earlier once the prompts are consumed.
    bound = 2 * math.ceil(args.num_train_epochs * len(dataset)) + 8
    per_epoch = math.ceil(bound / max(math.ceil(args.num_train_epochs), 1))
    return StepLoader(dataset, per_epoch * args.gradient_accumulation_steps)

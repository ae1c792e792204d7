"""The stand-in for the Trainer's train DataLoader: a step's batches come from the rollout source instead."""

from __future__ import annotations

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

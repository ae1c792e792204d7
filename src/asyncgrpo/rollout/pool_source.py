"""Prompt pools as the rollout worker's prompt source (``prompt_pools=True``; the pools: ``prompt_pools.py``).

Each prompt drawn gets the next flat index (from the checkpoint's first unsettled one, settled ones skipped), so
the trainer settles and checkpoints draws exactly as it does epoch order's prompts; the epoch of a draw is its flat
index over the dataset's length, and ``num_epochs`` bounds the draws to ``num_epochs × len(dataset)``. The flat
index is also the draw's number, which fixes its randomness and the results it sees (``prompt_pools.py``): a draw
whose results are not all back yields ``None``, and the group producer, which iterates synchronously, waits for a
group to finish and asks again. Settled draws past a resume point are not drawn again (their rows are in the
state). The iteration ends when every prompt is retired.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from asyncgrpo.rollout.prompt_order import PromptItem
from asyncgrpo.rollout.prompt_pools import PoolSettings, pass_fraction, resumed_pools


class PoolPromptSource:
    """A ``PromptSource`` drawing rows by difficulty; ``on_group`` feeds each finished group back.

    Args:
        dataset: a map-style dataset (pools index rows).
        settings: the pools' settings.
        start_index: the first flat index to give (resume).
        num_epochs: draws allowed, in dataset lengths (None: until every prompt retires or the trainer stops).
        skip: flat indices settled before a resume (not given again).
        state: the checkpoint's pools state (None: fresh pools).
        pass_threshold: a sample passes when its total reward is at least this.
    """

    def __init__(self, dataset: Any, settings: PoolSettings, start_index: int = 0, num_epochs: int | None = None,
                 skip: frozenset[int] = frozenset(), state: dict | None = None, pass_threshold: float = 1.0) -> None:  # fmt: skip
        if not hasattr(dataset, "__len__"):
            raise ValueError("prompt_pools needs a map-style training dataset (with a length); an IterableDataset "
                             "cannot be drawn from by row: set prompt_pools=False or materialise the dataset")  # fmt: skip
        self.dataset = dataset
        self.epoch_len: int | None = len(dataset)
        self.pools = resumed_pools(len(dataset), settings, state, start_index, skip)
        self.next_flat = start_index
        self.limit = num_epochs * len(dataset) if num_epochs is not None else None
        self.skip = skip
        self.pass_threshold = pass_threshold

    def __iter__(self) -> Iterator[PromptItem | None]:
        """The drawn prompts; ``None`` when the next draw must first learn a group still in flight."""
        n = len(self.dataset)
        while True:
            flat = self.next_flat
            while flat in self.skip:
                flat += 1
            if self.limit is not None and flat >= self.limit:
                return
            if not self.pools.ready(flat):
                yield None
                continue
            row = self.pools.draw(flat)
            if row is None:  # every prompt retired: no more data
                return
            self.next_flat = flat + 1
            yield PromptItem(flat // n, row, flat, self.dataset[row])

    def on_group(self, flat_index: int, rewards: list[float] | None) -> None:
        """A drawn prompt's group finished with these total rewards (None: rejected or not scored)."""
        row = self.pools.rows.get(flat_index)
        if row is not None:
            fraction = pass_fraction(rewards, self.pass_threshold) if rewards else None
            self.pools.learn(flat_index, row, fraction)

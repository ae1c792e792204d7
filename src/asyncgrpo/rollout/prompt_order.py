"""Which prompt the rollout worker takes next: the ``PromptSource`` interface and its default, ``PromptOrder``.

``PromptOrder`` walks epochs over the dataset from a flat start index (T3, T5, X3). Prompts are numbered over
epochs (``epoch × len(dataset) + row``). A resumed run starts at the checkpoint's first unsettled prompt and skips
the settled ones past it, so no prompt the checkpoint trained is generated again. A dataset without ``len`` (an
``IterableDataset``) is re-iterated each epoch; its length is learnt from the first pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol


class PromptItem(NamedTuple):
    """One prompt to generate a group for.

    ``flat_index`` is the key the trainer settles and checkpoints (``GroupResult.row_index``): a source must give
    each prompt it yields a flat index of its own, and resume from the checkpoint's first unsettled one.
    """

    epoch: int
    row_index: int  # the row in the dataset
    flat_index: int  # the prompt counted over the run (epochs: ``epoch * len(dataset) + row_index``)
    row: Any  # the dataset row (a conversational ``prompt`` and the reward functions' columns)


class PromptSource(Protocol):
    """What the group producer takes prompts from (``production.py``); ``AsyncRolloutLoop.prompt_source`` builds it.

    Its state lives in the checkpoint as the trainer's settled flat indices: a source is built from
    ``settings.dataset_start_index`` (the first unsettled prompt) and ``settings.skip_indices`` (settled past it).
    """

    epoch_len: int | None  # prompts in one epoch once known; the producer fails an epoch whose every prompt it rejected

    def __iter__(self) -> Iterator[PromptItem | None]:
        """The prompts in training order; ends when the data runs out. ``None``: the next prompt depends on a group
        in flight (prompt pools); the producer waits for a group to finish, then asks again."""
        ...


class PromptOrder:
    """The default ``PromptSource``: yields ``PromptItem(epoch, row_index, flat_index, row)`` in training order.

    Args:
        dataset: indexable with ``len``, or only iterable.
        start_index: the first flat index to take (resume); iterable datasets must start at 0.
        num_epochs: passes to make (None: until the caller stops).
        skip: flat indices to pass over (settled before a resume).
    """

    def __init__(self, dataset: Any, start_index: int = 0, num_epochs: int | None = None,
                 skip: frozenset[int] = frozenset()) -> None:  # fmt: skip
        self.dataset = dataset
        self.sized = hasattr(dataset, "__len__")
        if self.sized and len(dataset) == 0:
            raise ValueError("the training dataset is empty")
        if not self.sized and start_index:
            raise ValueError(
                "resuming needs a dataset with a length (the flat prompt index counts epochs); an IterableDataset "
                f"cannot skip to prompt #{start_index}: use a map-style dataset, or start a new run"
            )
        self.start_index = start_index
        self.num_epochs = num_epochs
        self.skip = skip
        self.epoch_len: int | None = len(dataset) if self.sized else None

    def epoch_rows(self, epoch: int) -> Iterator[tuple[int, int, Any]]:
        """``(row_index, flat_index, row)`` of one epoch, skipped prompts left out."""
        n = self.epoch_len
        first = self.start_index - epoch * n if n and epoch == self.start_index // n else 0
        rows = ((i, self.dataset[i]) for i in range(first, n)) if self.sized else enumerate(iter(self.dataset))
        seen = 0
        for row_index, row in rows:
            seen += 1
            flat = epoch * (n or 0) + row_index  # an iterable's length is known after epoch 0
            if flat not in self.skip:
                yield row_index, flat, row
        if not self.sized:
            if seen == 0:
                raise ValueError("the training dataset is empty (its iterator yielded no row)")
            self.epoch_len = self.epoch_len or seen

    def first_epoch(self) -> int:
        return self.start_index // self.epoch_len if self.epoch_len else 0

    def __iter__(self) -> Iterator[PromptItem]:
        for epoch in self.epochs():
            for row_index, flat_index, row in self.epoch_rows(epoch):
                yield PromptItem(epoch, row_index, flat_index, row)

    def epochs(self) -> Iterator[int]:
        epoch = self.first_epoch()
        while self.num_epochs is None or epoch < self.num_epochs:
            yield epoch
            epoch += 1

"""What the rollout worker sends the trainer: one :class:`GroupResult` per prompt taken.

Every prompt the worker takes produces exactly one result — trained, dropped
(zero std) or skipped (``filter_prompt``) — so the trainer can count epochs by
distinct prompts and knows the first prompt index not yet consumed (T3, T5).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncgrpo.types import TrainingSequence


@dataclass
class GroupResult:
    """One prompt's outcome. ``row_index`` counts over epochs (``epoch * len(dataset) + row``).

    Invariants: ``sequences`` is empty when ``dropped`` or ``skipped``; ``tokens`` is the sum of
    ``len(s.input_ids)`` over ``sequences`` (the unit of the staleness admission, G3).
    """

    row_index: int
    epoch: int
    group_id: int = -1
    model_version: int = 0
    sequences: list[TrainingSequence] = field(default_factory=list)
    dropped: bool = False
    skipped: bool = False
    end: bool = False  # no more data: the worker generated every requested epoch
    queued_at: float = 0.0  # time.time() when queued
    tokens: int = 0
    rewards: list[float] | None = None
    prompt_text: str | None = None
    completion_texts: list[str] | None = None
    tool_calls: int | None = None  # tool calls over the group's rollouts; None when the run has no tools
    dataset_row: int | None = None  # the dataset row generated (prompt pools draw rows in no fixed order)
    # A dropped (tied) group's samples as a row would forward them (shared prefixes once); its samples are not
    # sent, and with dynamic_sampling off this is its share of its step's token budget (rollout/dynamic_sampling.py).
    row_tokens: int = 0

    @classmethod
    def rejected(cls, row_index: int, epoch: int, dataset_row: int | None = None) -> GroupResult:
        """A prompt ``filter_prompt`` turned down (consumed for the epoch, nothing to train)."""
        return cls(row_index=row_index, epoch=epoch, skipped=True, dataset_row=dataset_row)

    @classmethod
    def end_of_data(cls) -> GroupResult:
        return cls(row_index=-1, epoch=-1, end=True)

"""Each process's share of one optimizer step: its row of every micro-batch and the loss normalizer (L5).

Rank 0 plans every process's rows (``rollout_source.py``); this splits them and attaches the global counts, so
every process divides by the same number whatever its own row holds.
"""

from __future__ import annotations

from asyncgrpo.packing import PackedRow
from asyncgrpo.trainer.loss_families import family_normalizer


def split_rows(
    packed: list[list[PackedRow]],
    gradient_accumulation_steps: int,
    num_processes: int,
    loss_type: str = "asyncgrpo",
    max_completion_length: int = 1,
) -> list[list[dict[str, object]]]:
    """Each process's share of a step: ``[{"row": its row or None, "normalizer": float}]`` per micro-batch.

    The planner already gave every micro-batch one row per process, balanced by attention cost; process i
    trains row i. The normalizer counts the trained tokens (or sequences, as ``loss_type`` says:
    ``family_normalizer``) of all the micro-batch's rows, or of the whole step: the global counts of L5, taken
    here on rank 0, which plans every process's rows, so every process divides by the same number whatever its
    own row holds (no all-reduce needed).
    """
    per_rank: list[list[dict[str, object]]] = [[] for _ in range(num_processes)]
    step_tokens = sum(r.num_trained for rows in packed for r in rows)
    for rows in packed:
        tokens = sum(r.num_trained for r in rows)
        sequences = sum(int(r.entry_sample.unique().numel()) for r in rows)
        norm = family_normalizer(loss_type, tokens, sequences, step_tokens, max_completion_length,
                                 gradient_accumulation_steps, num_processes)  # fmt: skip
        for rank in range(num_processes):
            per_rank[rank].append({"row": rows[rank] if rank < len(rows) else None, "normalizer": norm})
    return per_rank

"""``rollout_state.json``: where the rollout worker resumes (T5).

Each checkpoint records the index of the first untrained prompt (counted over
epochs: ``epoch × len(dataset) + row``). Resuming restarts the worker there, so
the next prompts are exactly the first untrained ones — nothing is replayed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

ROLLOUT_STATE_NAME = "rollout_state.json"


def write_rollout_state(checkpoint_dir: str | os.PathLike, first_untrained_prompt: int, dataset_len: int) -> Path:
    path = Path(checkpoint_dir) / ROLLOUT_STATE_NAME
    state = {
        "first_untrained_prompt": int(first_untrained_prompt),
        "epoch": int(first_untrained_prompt // max(dataset_len, 1)),
        "row_in_epoch": int(first_untrained_prompt % max(dataset_len, 1)),
        "dataset_len": int(dataset_len),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)  # atomic: a crash never leaves a half-written state
    return path


def read_rollout_state(checkpoint_dir: str | os.PathLike, dataset_len: int | None) -> int:
    """The first untrained prompt recorded in ``checkpoint_dir`` (0 when the file is absent).

    An iterable dataset (``dataset_len`` None) restarts at its first prompt.
    """
    path = Path(checkpoint_dir) / ROLLOUT_STATE_NAME
    if not path.is_file() or dataset_len is None:
        return 0
    state = json.loads(path.read_text())
    if state.get("dataset_len") not in (None, dataset_len):
        raise ValueError(
            f"{path} was written for a dataset of {state['dataset_len']} prompts but the training dataset has "
            f"{dataset_len}; resume with the same dataset, or start a new run without resume_from_checkpoint"
        )
    return int(state["first_untrained_prompt"])


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """``True`` means the newest checkpoint in ``output_dir``; a path is checked to exist."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        if last is None:
            raise ValueError(f"resume_from_checkpoint=True but {output_dir} holds no checkpoint-* folder")
        return last
    if not os.path.isdir(resume_from_checkpoint):
        raise ValueError(f"resume_from_checkpoint={resume_from_checkpoint!r} is not a directory")
    return str(resume_from_checkpoint)

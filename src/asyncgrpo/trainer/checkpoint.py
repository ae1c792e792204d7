"""``rollout_state.json``: where the rollout worker resumes (T5, X3).

Each checkpoint records the index of the first unsettled prompt (counted over
epochs: ``epoch × len(dataset) + row``) and the outcome of every settled prompt
past it (``trained``, ``zero_std``, ``rejected``, ``stale``, ``invalid``), and with
prompt pools on, the pools' state as the settled groups left it (``rollout/prompt_pools.py``).
Resuming restarts the worker at the first unsettled prompt and skips the settled
ones, except prompts only dropped as stale, which are generated again: nothing
the checkpoint's weights trained is trained twice, nothing is lost.

The file is written last, atomically, after transformers wrote the checkpoint's
model and optimizer: a checkpoint folder without it was cut short by a crash, and
``resolve_checkpoint(True)`` passes over it.

Under FSDP2 the model and optimizer state are transformers' and accelerate's
(``fsdp_config["state_dict_type"]``: ``SHARDED_STATE_DICT`` has every rank write
and read its own shards through torch distributed checkpoint); this file is rank
0's alone, since only rank 0 runs the rollout worker.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from transformers.trainer_utils import get_last_checkpoint

logger = logging.getLogger(__name__)

ROLLOUT_STATE_NAME = "rollout_state.json"


def write_rollout_state(
    checkpoint_dir: str | os.PathLike,
    first_untrained_prompt: int,
    dataset_len: int,
    settled: dict[int, str] | None = None,
    step: int | None = None,
    num_tokens: float = 0.0,
    pools: dict | None = None,
) -> Path:
    path = Path(checkpoint_dir) / ROLLOUT_STATE_NAME
    state = {
        "first_untrained_prompt": int(first_untrained_prompt),
        "epoch": int(first_untrained_prompt // max(dataset_len, 1)),
        "row_in_epoch": int(first_untrained_prompt % max(dataset_len, 1)),
        "dataset_len": int(dataset_len),
        "step": step,
        "num_tokens": float(num_tokens),
        "settled": {str(k): v for k, v in sorted((settled or {}).items())},
    }
    if pools is not None:
        state["pools"] = pools
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


def read_settled(checkpoint_dir: str | os.PathLike | None) -> dict[int, str]:
    """Outcomes of the settled prompts past the first unsettled one ({} for older state files or no checkpoint)."""
    path = Path(checkpoint_dir) / ROLLOUT_STATE_NAME if checkpoint_dir else None
    if path is None or not path.is_file():
        return {}
    return {int(k): str(v) for k, v in json.loads(path.read_text()).get("settled", {}).items()}


def read_num_tokens(checkpoint_dir: str | os.PathLike | None) -> float:
    """The ``num_tokens`` running total at the checkpoint (0 for older state files or no checkpoint)."""
    path = Path(checkpoint_dir) / ROLLOUT_STATE_NAME if checkpoint_dir else None
    if path is None or not path.is_file():
        return 0.0
    return float(json.loads(path.read_text()).get("num_tokens", 0.0))


def read_pools(checkpoint_dir: str | os.PathLike | None) -> dict | None:
    """The prompt pools' state at the checkpoint (None: pools were off, or no checkpoint)."""
    path = Path(checkpoint_dir) / ROLLOUT_STATE_NAME if checkpoint_dir else None
    if path is None or not path.is_file():
        return None
    return json.loads(path.read_text()).get("pools")


def checkpoint_step(checkpoint_dir: str | os.PathLike) -> int:
    """The optimizer step a ``checkpoint-N`` folder holds (N)."""
    name = Path(checkpoint_dir).name
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        raise ValueError(f"{checkpoint_dir} is not a checkpoint-<step> folder") from None


def trim_metrics_file(path: str | os.PathLike, step: int) -> int:
    """Drop the lines of ``metrics.jsonl`` logged after ``step`` (a killed run's last steps are trained again).

    Returns how many lines were dropped. Rewritten atomically; unreadable lines (a write cut by the kill) go too.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            keep = int(json.loads(line).get("step", 0)) <= step
        except (ValueError, AttributeError, TypeError):
            keep = False
        if keep:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in kept))
        os.replace(tmp, path)
    return dropped


def _complete_checkpoints(output_dir: str) -> list[Path]:
    found = []
    for p in Path(output_dir).glob("checkpoint-*"):
        try:
            step = checkpoint_step(p)
        except ValueError:
            continue
        if p.is_dir() and (p / ROLLOUT_STATE_NAME).is_file():
            found.append((step, p))
    return [p for _, p in sorted(found)]


def resolve_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """Which checkpoint a run resumes from.

    ``True``: the newest complete checkpoint in ``output_dir``; ``"auto"``: the same, or a fresh start when there
    is none (a job that is simply restarted after a crash or preemption); a path is checked to exist. Complete
    means its ``rollout_state.json`` exists: that file is written last, so a run killed while saving leaves a
    folder without it, which cannot be resumed.
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True or resume_from_checkpoint == "auto":
        auto = resume_from_checkpoint == "auto"
        last = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
        complete = _complete_checkpoints(output_dir) if last is not None else []
        if last is None and auto:
            logger.info("resume_from_checkpoint='auto': %s holds no checkpoint yet, starting from step 0", output_dir)
            return None
        if last is None:
            raise ValueError(
                f"resume_from_checkpoint=True but {output_dir} holds no checkpoint-* folder; start without it, or "
                "pass resume_from_checkpoint='auto' (resume when a checkpoint exists, else start fresh)"
            )
        if not complete:
            cut = f"{last} has no {ROLLOUT_STATE_NAME}: the run stopped while saving it, so it cannot be resumed"
            if auto:
                logger.warning("%s; no complete checkpoint in %s, starting from step 0", cut, output_dir)
                return None
            raise ValueError(
                f"{cut}, and {output_dir} holds no complete checkpoint. Delete {last} to start fresh, or pass "
                "resume_from_checkpoint='auto' (--resume auto), which starts fresh in this case"
            )
        if Path(last) != complete[-1]:
            logger.warning("%s has no %s (a crash cut its save short): resuming from %s", last,
                           ROLLOUT_STATE_NAME, complete[-1])  # fmt: skip
        return str(complete[-1])
    if not os.path.isdir(resume_from_checkpoint):
        raise ValueError(
            f"resume_from_checkpoint={resume_from_checkpoint!r} is not a directory; pass a checkpoint-* folder, "
            "True (the newest in output_dir) or 'auto'"
        )
    return str(resume_from_checkpoint)


@dataclass(frozen=True)
class ResumePoint:
    """Where a run restarts: the first unsettled prompt, the settled outcomes past it, the running token count
    and the prompt pools' state."""

    start_index: int = 0
    settled: dict[int, str] = field(default_factory=dict)
    num_tokens: float = 0.0
    pools: dict | None = None

    @property
    def skip(self) -> frozenset[int]:
        """Prompts the worker must not generate again: every settled one but those only dropped as stale."""
        return frozenset(i for i, outcome in self.settled.items() if outcome != "stale")


def prepare_resume(
    checkpoint_dir: str | None, dataset_len: int | None, output_dir: str, *, restarted: bool = False
) -> ResumePoint:
    """Read a checkpoint's rollout state and trim ``metrics.jsonl`` to its step (rank 0; X3).

    The steps after the checkpoint are trained again, so their old lines would appear twice in the file. A run
    ``restarted`` from step 0 (``resume_from_checkpoint="auto"`` found no complete checkpoint) drops them all.
    """
    if not checkpoint_dir:
        cut = trim_metrics_file(Path(output_dir) / "metrics.jsonl", 0) if restarted else 0
        if cut:
            logger.warning("starting again from step 0: %d metrics.jsonl lines of the earlier attempt removed", cut)
        return ResumePoint()
    point = ResumePoint(
        read_rollout_state(checkpoint_dir, dataset_len),
        read_settled(checkpoint_dir),
        read_num_tokens(checkpoint_dir),
        read_pools(checkpoint_dir),
    )
    step = checkpoint_step(checkpoint_dir)
    cut = trim_metrics_file(Path(output_dir) / "metrics.jsonl", step)
    retried = sum(outcome == "stale" for outcome in point.settled.values())
    logger.warning(
        "resuming from %s: prompts from #%d on; %d settled past it are skipped, %d only dropped as stale are retried; "
        "%d metrics.jsonl lines logged after step %d removed",
        checkpoint_dir, point.start_index, len(point.settled) - retried, retried, cut, step,
    )  # fmt: skip
    return point

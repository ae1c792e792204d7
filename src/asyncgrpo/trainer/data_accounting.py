"""The trainer's side of dynamic sampling and prompt pools: per-step counts, the pools' settled state (issue 36).

``RolloutSource`` tells it of every group it pulls and of every prompt it settles:

* dynamic sampling: each pulled group counts as generated, and as kept when it has a signal (not dropped for tied
  rewards); per step that gives ``dynamic_sampling/*`` (logged in every run: with the switch off they give the
  natural tie rate) and, with ``dynamic_sampling`` on, tells the step when the cap stops it filling (one line);
* prompt pools: the trainer keeps its own ``PromptPools`` and records a group's pass fraction only once its prompt
  is *settled* (trained, or dropped for tied rewards), in settlement order. A checkpoint saves that copy, so it
  holds exactly what the checkpoint's weights settled: groups pulled but not yet trained, or dropped as stale, are
  generated again after a resume and counted then, never twice. The worker's own pools (which learn as soon as a
  group is scored, ahead of the trainer) start from this state when a run resumes.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncgrpo.rollout.dynamic_sampling import OverSamplingCount
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompt_pools import PromptPools, pass_fraction

logger = logging.getLogger(__name__)

RECORDED_OUTCOMES = ("trained", "zero_std", "invalid")  # a group was scored; stale and rejected teach nothing


class DataAccounting:
    """Dynamic sampling's counts and the settled prompt pools (either may be off).

    Args:
        oversampling: the per-step count (None: not counted).
        pools: the trainer's copy of the pools, or None when prompt pools are off.
        pass_threshold: a sample passes when its total reward is at least this.
        dynamic: ``dynamic_sampling``: tied groups take no room in a step (off: their share, ``step_fill.py``).
    """

    def __init__(
        self,
        oversampling: OverSamplingCount | None,
        pools: PromptPools | None,
        pass_threshold: float,
        dynamic: bool = True,
    ) -> None:
        self.oversampling = oversampling
        self.dynamic = dynamic
        self.pools = pools
        self.pass_threshold = pass_threshold
        self._unsettled: dict[int, tuple[int, float | None]] = {}  # flat index -> (dataset row, pass fraction)

    @classmethod
    def build(cls, args: Any, dataset_len: int | None, resume: Any) -> DataAccounting:
        """From the config and the resume point (its ``pools`` state)."""
        from asyncgrpo.config_data import pool_settings

        count = OverSamplingCount(args.dynamic_sampling_max_factor, enforce_cap=args.dynamic_sampling)
        pools = None
        if args.prompt_pools:
            if not dataset_len:
                raise ValueError("prompt_pools needs a training dataset with a length (a map-style dataset)")
            pools = PromptPools(dataset_len, pool_settings(args))
            if resume.pools is not None:
                pools.load_state_dict(resume.pools)
        return cls(count, pools, args.pass_threshold, dynamic=args.dynamic_sampling)

    def on_pulled(self, res: GroupResult, step: int) -> None:
        """A scored group reached the trainer (not a duplicate of a settled prompt)."""
        if res.skipped:
            return
        if self.oversampling is not None:
            self.oversampling.on_group(kept=not res.dropped and bool(res.sequences))
        if self.pools is not None and res.dataset_row is not None:
            self._unsettled[res.row_index] = (res.dataset_row, pass_fraction(res.rewards or [], self.pass_threshold))

    def cap_stops(self, step: int, held_samples: int) -> bool:
        """Whether step ``step``, holding ``held_samples`` samples to train, stops filling at the over-sampling cap
        (``dynamic_sampling`` on); says so in one line when it does."""
        count = self.oversampling
        if count is None or not held_samples or not count.over_cap:
            return False
        logger.warning("%s", count.stop(step, held_samples))
        return True

    def on_settled(self, flat_index: int, outcome: str) -> None:
        """A prompt settled: its group now counts in the pools (or, stale, is forgotten: it is generated again)."""
        entry = self._unsettled.pop(flat_index, None)
        if entry is not None and self.pools is not None and outcome in RECORDED_OUTCOMES:
            self.pools.record(entry[0], entry[1], count_draw=True)

    def step_metrics(self) -> list[tuple[str, float, float]]:
        """The step's ``dynamic_sampling/*`` and ``pools/*`` figures (then the counts start again)."""
        out = []
        if self.oversampling is not None:
            out += [(name, value, 1.0) for name, value in self.oversampling.close_step()]
        if self.pools is not None:
            out += [(name, value, 1.0) for name, value in self.pools.metrics().items()]
        return out

    def pools_state(self) -> dict | None:
        return self.pools.state_dict() if self.pools is not None else None

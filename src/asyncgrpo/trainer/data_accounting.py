"""The trainer's side of dynamic sampling and prompt pools: per-step counts, the pools' settled state (issue 36).

``RolloutSource`` tells it of every group it pulls and of every prompt it settles:

* dynamic sampling: each pulled group counts as generated, and as kept when it has a signal (not dropped for tied
  rewards); per step that gives ``dynamic_sampling/*`` (logged in every run: with the switch off they give the
  natural tie rate) and, with ``dynamic_sampling`` on, tells the step when the cap stops it filling (one line);
* prompt pools: the trainer keeps its own ``PromptPools`` and learns a group's pass fraction, under its draw
  number (the flat index), only once its prompt is *settled* (trained, dropped for tied rewards or as stale,
  rejected); the copy applies results in draw order, as the worker's pools do (``PromptPools.settle``). A
  checkpoint saves that copy plus the results of partly trained prompts (settled for the resume too), so it holds
  exactly what a worker resumed at the checkpoint's first unsettled prompt needs to draw what the uninterrupted
  worker drew: groups pulled but not trained are generated again after a resume and learnt then, never twice.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from asyncgrpo.rollout.dynamic_sampling import OverSamplingCount
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompt_pools import PromptPools, pass_fraction, resumed_pools

logger = logging.getLogger(__name__)


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
        self._pulled: dict[int, tuple[int, float | None]] = {}  # unsettled flat index -> (dataset row, pass fraction)

    @classmethod
    def build(cls, args: Any, dataset_len: int | None, resume: Any) -> DataAccounting:
        """From the config and the resume point (its ``pools`` state)."""
        from asyncgrpo.config_data import pool_settings

        count = OverSamplingCount(args.dynamic_sampling_max_factor, enforce_cap=args.dynamic_sampling)
        pools = None
        if args.prompt_pools:
            if not dataset_len:
                raise ValueError("prompt_pools needs a training dataset with a length (a map-style dataset)")
            pools = resumed_pools(dataset_len, pool_settings(args), resume.pools, resume.start_index, resume.skip)
        return cls(count, pools, args.pass_threshold, dynamic=args.dynamic_sampling)

    def on_pulled(self, res: GroupResult, step: int) -> None:
        """A group (scored, or rejected by ``filter_prompt``) reached the trainer, not a duplicate of a settled one."""
        if self.pools is not None and res.dataset_row is not None:
            fraction = None if res.skipped else pass_fraction(res.rewards or [], self.pass_threshold)
            self._pulled[res.row_index] = (res.dataset_row, fraction)
        if res.skipped:
            return
        if self.oversampling is not None:
            self.oversampling.on_group(kept=not res.dropped and bool(res.sequences))

    def cap_stops(self, step: int, held_samples: int) -> bool:
        """Whether step ``step``, holding ``held_samples`` samples to train, stops filling at the over-sampling cap
        (``dynamic_sampling`` on); says so in one line when it does."""
        count = self.oversampling
        if count is None or not held_samples or not count.over_cap:
            return False
        logger.warning("%s", count.stop(step, held_samples))
        return True

    def on_settled(self, flat_index: int, outcome: str) -> None:
        """A prompt settled (any outcome: the worker's pools learnt its group whatever the trainer did with it)."""
        entry = self._pulled.pop(flat_index, None)
        if entry is not None and self.pools is not None:
            self.pools.learn(flat_index, *entry)
            self.pools.settle()

    def plan_metrics(self) -> list[tuple[str, float, float]]:
        """The planned step's ``dynamic_sampling/*`` counts (then they start again)."""
        if self.oversampling is None:
            return []
        return [(name, value, 1.0) for name, value in self.oversampling.close_step()]

    def pools_metrics(self) -> list[tuple[str, float, float]]:
        """``pools/*`` of the settled copy; read once the step has settled what it trained, so step N's figures
        are the pools its checkpoint saves."""
        if self.pools is None:
            return []
        return [(name, value, 1.0) for name, value in self.pools.metrics().items()]

    def pools_state(self, partial: Iterable[int] = ()) -> dict | None:
        """The settled pools for a checkpoint, plus the results of ``partial``: prompts with some samples trained,
        which the checkpoint counts as settled (a resume does not generate them again)."""
        if self.pools is None:
            return None
        copy = PromptPools(self.pools.n, self.pools.s)
        copy.load_state_dict(self.pools.state_dict())
        for flat in partial:
            if flat in self._pulled:
                copy.learn(flat, *self._pulled[flat])
        copy.settle()
        return copy.state_dict()

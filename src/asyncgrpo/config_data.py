"""The data side's config fields (issue 36): dynamic sampling, prompt pools and the pass threshold of evaluation.

``AsyncGRPOConfig`` inherits ``DataFields``; ``data_problems`` is called by ``config_checks.config_problems`` so
its problems are reported with the rest, each with its fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DATA_FIELDS = (
    "dynamic_sampling", "dynamic_sampling_max_factor", "prompt_pools", "prompt_pool_thresholds",
    "prompt_pool_weights", "prompt_pool_retire_at", "prompt_pool_min_groups", "prompt_pool_requeue_delay",
    "prompt_pool_ema", "prompt_pool_lag", "pass_threshold",
)  # fmt: skip


@dataclass
class DataFields:
    """Which prompts are generated and how samples are kept and scored (see docs/usage.md)."""

    dynamic_sampling: bool = field(
        default=True,
        metadata={
            "help": "Groups whose rewards all tie are dropped from the loss either way. On (DAPO's dynamic "
            "sampling, the reference's default), a step keeps filling its token budget with groups that have a "
            "signal, until it has pulled more than dynamic_sampling_max_factor groups per kept one (then it trains "
            "a smaller step and says so). Off (TRL without DAPO), a tied group keeps its room in the step and is not "
            "replaced: no over-sampling, smaller steps."
        },
    )
    dynamic_sampling_max_factor: float = field(
        default=8.0,
        metadata={
            "help": "With dynamic_sampling on, a step that has pulled more than this many groups per kept group "
            "stops filling and trains what it holds (dynamic_sampling/cap_hit); 1: no over-sampling past a tie."
        },
    )
    prompt_pools: bool = field(
        default=False,
        metadata={
            "help": "Draw prompts from difficulty pools (by running pass rate) instead of epoch order; solved "
            "prompts retire, unsolved ones return after a delay (pools/* metrics)."
        },
    )
    prompt_pool_thresholds: list[float] = field(
        default_factory=lambda: [0.2, 0.8],
        metadata={"help": "Ascending pass-rate cuts between pools (two cuts: hard < 0.2 <= medium < 0.8 <= easy)."},
    )
    prompt_pool_weights: list[float] = field(
        default_factory=lambda: [1.0, 1.0, 2.0, 1.0],
        metadata={"help": "Sampling weight of each pool: 'new' (never returned) first, then hardest to easiest."},
    )
    prompt_pool_retire_at: float = field(
        default=1.0, metadata={"help": "A prompt whose running pass rate reaches this is retired (solved)."}
    )
    prompt_pool_min_groups: int = field(default=2, metadata={"help": "Groups a prompt needs before it can retire."})
    prompt_pool_requeue_delay: int = field(
        default=64, metadata={"help": "Draws an unsolved prompt (pass rate 0) waits before it is drawn again."}
    )
    prompt_pool_ema: float = field(
        default=0.5, metadata={"help": "Weight of a prompt's newest group in its running pass rate (1: last only)."}
    )
    prompt_pool_lag: int = field(
        default=32,
        metadata={
            "help": "Draws between a prompt's draw and the first draw that sees its result; results are learnt in "
            "draw order, so which prompts are drawn never depends on when groups return. At most lag + 1 groups "
            "are in flight."
        },
    )
    pass_threshold: float = field(
        default=1.0,
        metadata={"help": "A sample passes when its total reward is at least this (prompt pools, eval pass@k/maj@k)."},
    )


def data_problems(cfg: Any) -> list[str]:
    """The data fields' invalid values, each with its fix."""
    p = []
    if cfg.dynamic_sampling_max_factor < 1:
        p.append(f"dynamic_sampling_max_factor={cfg.dynamic_sampling_max_factor}: must be >= 1 (1: no over-sampling)")
    if cfg.prompt_pools:  # the pool fields are read only when pools are on
        p += pool_settings(cfg).problems()
    return p


def pool_settings(cfg: Any) -> Any:
    """The ``PoolSettings`` the config's ``prompt_pool_*`` fields describe."""
    from asyncgrpo.rollout.prompt_pools import PoolSettings

    return PoolSettings(
        thresholds=tuple(float(x) for x in cfg.prompt_pool_thresholds),
        weights=tuple(float(x) for x in cfg.prompt_pool_weights),
        retire_at=float(cfg.prompt_pool_retire_at),
        min_groups=int(cfg.prompt_pool_min_groups),
        requeue_delay=int(cfg.prompt_pool_requeue_delay),
        ema=float(cfg.prompt_pool_ema),
        seed=int(cfg.seed),
        lag=int(cfg.prompt_pool_lag),
    )

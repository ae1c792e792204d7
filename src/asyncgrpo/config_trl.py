"""The six ``AsyncGRPOConfig`` fields of TRL 1.16's ``trl.experimental.async_grpo`` that this library names otherwise
or did not have, so a TRL 1.16 config moves over unchanged (docs/usage.md, "Coming from TRL 1.16").

Two are other names of ours: ``max_inflight_tasks`` sets ``max_concurrent_rollouts`` and ``heartbeat_stale_after_s``
sets ``rollout_worker_timeout`` (:data:`ALIASES`). An alias left at TRL's default changes nothing; one set away from
it sets ours, and ``describe_aliases`` gives the run's start line that says so. Setting both names to different
values is refused: the config cannot tell which one was meant. The other four are behaviours: a timeout on each
generation request (``request_timeout``), one on each weight-transfer round (``weight_sync_timeout``), a bound on
the samples waiting in the rollout queue (``queue_maxsize``) and the multi-turn realign threshold
(``fork_threshold_tokens``, ``rollout/reconcile.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# alias -> (our field it sets, the alias's value that sets nothing: TRL's default)
ALIASES: dict[str, tuple[str, Any]] = {
    "max_inflight_tasks": ("max_concurrent_rollouts", -1),
    "heartbeat_stale_after_s": ("rollout_worker_timeout", 300.0),
}
TARGET_DEFAULTS = {"max_concurrent_rollouts": 512, "rollout_worker_timeout": 300.0}  # config.py's defaults
TRL_FIELDS = (
    "max_inflight_tasks", "queue_maxsize", "heartbeat_stale_after_s", "request_timeout", "weight_sync_timeout",
    "fork_threshold_tokens",
)  # fmt: skip


@dataclass
class TRLFields:
    """TRL 1.16 names (see the module docstring); ``AsyncGRPOConfig`` inherits them."""

    max_inflight_tasks: int = field(
        default=-1,
        metadata={
            "help": "TRL 1.16 name of max_concurrent_rollouts: >= 1 sets it; -1 (auto) keeps it (max_staleness "
            "paces generation in tokens). Both set to different values: refused."
        },
    )
    queue_maxsize: int = field(
        default=1024,
        metadata={
            "help": "Most scored samples waiting for the trainer in the rollout queue; a group that does not fit "
            "waits (unless the queue is empty). 0: no bound."
        },
    )
    heartbeat_stale_after_s: float = field(
        default=300.0,
        metadata={
            "help": "TRL 1.16 name of rollout_worker_timeout: set away from 300 it sets it. Both set to different "
            "values: refused."
        },
    )
    request_timeout: float = field(
        default=600.0,
        metadata={
            "help": "Seconds a generation request waits for its answer. Past it the request is not retried: the "
            "run stops naming request_timeout (one of several servers is dropped instead)."
        },
    )
    weight_sync_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds each wait of a weight sync may take (a custom weight_transfer: each round). Past it the "
            "run stops naming weight_sync_timeout instead of hanging."
        },
    )
    fork_threshold_tokens: int = field(
        default=0,
        metadata={
            "help": "A multi-turn prompt that drifts inside the last answer by fewer tokens realigns (those tokens "
            "become context) instead of forking. 0: always fork (TRL 1.16: 1024)."
        },
    )


def resolve_trl_aliases(cfg: Any) -> list[str]:
    """Apply the aliases to ``cfg`` (an ``AsyncGRPOConfig``); return the problems, each one line.

    Records what was applied in ``cfg.trl_aliases_applied`` (for the start line), and mirrors ours into an alias
    left unset, so both names read the same value afterwards.
    """
    problems: list[str] = []
    applied: list[str] = []
    if cfg.max_inflight_tasks == 0 or cfg.max_inflight_tasks < -1:
        problems.append(f"max_inflight_tasks={cfg.max_inflight_tasks}: must be >= 1, or -1 for auto")
    if not cfg.heartbeat_stale_after_s > 0:
        problems.append(f"heartbeat_stale_after_s={cfg.heartbeat_stale_after_s}: must be > 0 seconds")
    if problems:
        return problems + _behaviour_problems(cfg)
    for alias, (target, unset) in ALIASES.items():
        value, ours = getattr(cfg, alias), getattr(cfg, target)
        alias_set, target_set = value != unset, ours != TARGET_DEFAULTS[target]
        if alias_set and target_set and value != ours:
            problems.append(
                f"{alias}={value} and {target}={ours}: {alias} is TRL 1.16's name of {target}; set only one of them"
            )
        elif alias_set:
            setattr(cfg, target, type(ours)(value))
            applied.append(f"{alias}={value} -> {target}={getattr(cfg, target)}")
        elif target_set and alias == "heartbeat_stale_after_s":  # -1 (auto) keeps its meaning for the other
            setattr(cfg, alias, float(ours))
    cfg.trl_aliases_applied = tuple(applied)
    return problems + _behaviour_problems(cfg)


def _behaviour_problems(cfg: Any) -> list[str]:
    p: list[str] = []
    for name in ("request_timeout", "weight_sync_timeout"):
        if not getattr(cfg, name) > 0:
            p.append(f"{name}={getattr(cfg, name)}: must be > 0 seconds")
    if cfg.queue_maxsize < 0:
        p.append(f"queue_maxsize={cfg.queue_maxsize}: must be >= 0 (0 = no bound)")
    if cfg.fork_threshold_tokens < 0:
        p.append(f"fork_threshold_tokens={cfg.fork_threshold_tokens}: must be >= 0 (0 = every drift forks)")
    return p


def describe_aliases(cfg: Any) -> str | None:
    """The run's start line about TRL 1.16 names that set ours, or None when none did."""
    applied = getattr(cfg, "trl_aliases_applied", ())
    if not applied:
        return None
    return "TRL 1.16 names in the config: " + "; ".join(applied)

"""The loss-family and sampler-correction fields of ``AsyncGRPOConfig``, with TRL's names and meanings.

``loss_type`` picks the objective: ``"asyncgrpo"`` (default) is the reference document's (score centering or the
clipped surrogate, token-level masked importance sampling, L1-L5); ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` and
``cispo`` are TRL's, each written from its paper (``trainer/loss_families.py``). ``importance_sampling_level``
turns the policy ratio into GSPO's sequence ratio. The ``vllm_importance_sampling_*`` fields pick the sampler
correction (``trainer/sampler_correction.py``). Which combinations are valid is decided here, once, so a bad one
stops the run at config time with what to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LOSS_TYPES = ("asyncgrpo", "grpo", "bnpo", "dr_grpo", "dapo", "cispo")
IS_LEVELS = ("token", "sequence", "sequence_token")
IS_MODES = ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate", "icepop")
SCALE_REWARDS = ("group", "none")
DAPO_EPSILON_HIGH = 0.28  # DAPO paper's clip-higher (arXiv 2503.14476)
CISPO_EPSILON_MAX = 5.0  # ScaleRL's recommended cap of the CISPO weight (arXiv 2510.13786)

__all__ = ["IS_LEVELS", "IS_MODES", "LOSS_TYPES", "LossFields", "loss_field_problems", "resolve_loss_fields"]


@dataclass
class LossFields:
    """The loss family and the sampler correction (a base of ``AsyncGRPOConfig``)."""

    loss_type: str = field(
        default="asyncgrpo",
        metadata={
            "help": "Objective: 'asyncgrpo' (the reference objective: score centering, or the clipped surrogate "
            "with score_centering=False), or TRL's 'grpo' (per-sequence mean, then mean over sequences), 'bnpo' "
            "(mean over the micro-batch's tokens), 'dr_grpo' (sum over max_completion_length x sequences, no std "
            "scaling of rewards), 'dapo' (sum over the step's tokens; epsilon_high defaults to 0.28) or 'cispo' "
            "(clipped, stop-gradient importance weight x advantage x log-prob; epsilon_high is the weight cap, "
            "default 5.0). See docs/usage.md, 'Loss types and sampler corrections'."
        },
    )
    importance_sampling_level: str = field(
        default="token",
        metadata={
            "help": "'token': one policy ratio per token; 'sequence': GSPO's length-normalised sequence ratio "
            "exp(mean over the sequence of log pi_theta - log pi_old), clipped per sequence (use loss_type='grpo', "
            "epsilon=3e-4, epsilon_high=4e-4 as the GSPO paper); 'sequence_token': GSPO-token, the sequence ratio "
            "times pi_theta/sg(pi_theta) per token. Not with loss_type='asyncgrpo'."
        },
    )
    scale_rewards: str | None = field(
        default=None,
        metadata={
            "help": "'group': advantages are rewards minus the group mean, divided by the group std; 'none': not "
            "divided (Dr. GRPO). None: 'none' for loss_type='dr_grpo', else 'group'. True/False are read as "
            "'group'/'none'."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=True,
        metadata={
            "help": "Correct for the gap between the sampler's log-probs and the trainer's (staleness and numerics) "
            "with the weight chosen by vllm_importance_sampling_mode. With loss_type='asyncgrpo' it is the "
            "reference's masked importance sampling; False trains on every token unweighted by it."
        },
    )
    vllm_importance_sampling_mode: str = field(
        default="token_mask",
        metadata={
            "help": "'token_mask' (tokens whose ratio pi_trainer/pi_sampler lies outside [clip_min, clip_max] get "
            "weight 0, the others weight ratio; the reference's masked IS), 'token_truncate' (TIS: weight "
            "clamp(ratio, clip_min, clip_max)), 'sequence_mask' / 'sequence_truncate' (the same on the product of "
            "a sequence's ratios, one weight per sequence), 'icepop' (token mask on [1/clip_max, clip_max])."
        },
    )
    vllm_importance_sampling_cap: float | None = field(
        default=None,
        metadata={"help": "TRL's older name of vllm_importance_sampling_clip_max; when set it replaces it."},
    )


def resolve_loss_fields(cfg: Any) -> None:
    """Fill the defaults that depend on ``loss_type`` (called by ``AsyncGRPOConfig.__post_init__`` first).

    DAPO's clip-higher and CISPO's weight cap become ``epsilon_high``'s default; Dr. GRPO turns off the std scaling;
    score centering belongs to the reference objective only; the TRL alias ``vllm_importance_sampling_cap``
    replaces ``vllm_importance_sampling_clip_max``.
    """
    if isinstance(cfg.loss_type, str):
        cfg.loss_type = cfg.loss_type.lower()
    if cfg.epsilon_high is None and cfg.loss_type == "dapo":
        cfg.epsilon_high = DAPO_EPSILON_HIGH
    if cfg.epsilon_high is None and cfg.loss_type == "cispo":
        cfg.epsilon_high = CISPO_EPSILON_MAX
    if cfg.scale_rewards is None:
        cfg.scale_rewards = "none" if cfg.loss_type == "dr_grpo" else "group"
    elif isinstance(cfg.scale_rewards, bool) or str(cfg.scale_rewards).lower() in ("true", "false"):
        cfg.scale_rewards = "group" if str(cfg.scale_rewards).lower() == "true" else "none"
    if cfg.loss_type != "asyncgrpo":
        cfg.score_centering = False  # the families train on the sampled tokens only; no top-N to request
    if cfg.vllm_importance_sampling_cap is not None:
        cfg.vllm_importance_sampling_clip_max = cfg.vllm_importance_sampling_cap


def loss_field_problems(cfg: Any) -> list[str]:
    """Invalid values and combinations of the loss fields, each with its fix (``config_checks`` calls it)."""
    p: list[str] = []
    if cfg.loss_type == "gspo":
        return [
            (
                "loss_type='gspo': GSPO is importance_sampling_level='sequence' with loss_type='grpo' (epsilon=3e-4, "
                "epsilon_high=4e-4 as in the paper)"
            )
        ]
    if cfg.loss_type not in LOSS_TYPES:
        p.append(f"loss_type={cfg.loss_type!r}: must be one of {', '.join(LOSS_TYPES)}")
        return p
    if cfg.importance_sampling_level not in IS_LEVELS:
        p.append(f"importance_sampling_level={cfg.importance_sampling_level!r}: must be one of {', '.join(IS_LEVELS)}")
    elif cfg.importance_sampling_level != "token" and cfg.loss_type == "asyncgrpo":
        p.append(
            f"importance_sampling_level={cfg.importance_sampling_level!r} with loss_type='asyncgrpo': the reference objective is token-level; "
            "for GSPO set loss_type='grpo'"
        )
    if cfg.vllm_importance_sampling_mode not in IS_MODES:
        p.append(
            f"vllm_importance_sampling_mode={cfg.vllm_importance_sampling_mode!r}: must be one of {', '.join(IS_MODES)}"
        )
    elif (
        cfg.loss_type == "asyncgrpo"
        and cfg.vllm_importance_sampling_correction
        and cfg.vllm_importance_sampling_mode not in ("token_mask", "icepop")
    ):
        p.append(
            f"vllm_importance_sampling_mode={cfg.vllm_importance_sampling_mode!r} with loss_type='asyncgrpo': the "
            "reference objective masks tokens ('token_mask' or 'icepop'); for truncation or sequence-level "
            "corrections choose a TRL loss_type such as 'dapo'"
        )
    if cfg.vllm_importance_sampling_mode == "icepop" and not cfg.vllm_importance_sampling_clip_max > 1:
        p.append(
            f"vllm_importance_sampling_clip_max={cfg.vllm_importance_sampling_clip_max}: icepop keeps ratios in "
            "[1/clip_max, clip_max], so clip_max must be > 1 (the IcePop paper uses 5)"
        )
    if str(cfg.scale_rewards) not in SCALE_REWARDS:
        p.append(
            f"scale_rewards={cfg.scale_rewards!r}: must be 'group' or 'none' ('batch' is not offered: an "
            "asynchronous step has no fixed batch of groups to take a std over)"
        )
    if cfg.loss_type == "cispo" and not cfg.epsilon_high > 1:
        p.append(
            f"epsilon_high={cfg.epsilon_high} with loss_type='cispo': it caps the importance weight itself, so it "
            "must be > 1; set epsilon_high=5.0 (ScaleRL) or leave it unset"
        )
    return p

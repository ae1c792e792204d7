"""Records that cross process boundaries: turns, rollouts, groups and training sequences.

Data path (docs/design.md): a dataset row becomes `num_generations` `Rollout`s, each made of one `TurnRecord`
per sampling request; the G rollouts of one prompt are scored together as a `RolloutGroup`; reconciliation
turns each rollout into one or more `TrainingSequence`s, the only thing the trainer consumes. Field names of
the first three follow the reference exactly (T9 in docs/spec.md), so custom `AsyncRolloutLoop` code written against
it works unchanged. Every record pickles (it crosses the worker -> trainer queue) and has a `validate()`
that raises `ValueError` naming the broken invariant.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from itertools import chain, compress
from typing import Any

import numpy as np

__all__ = ["Rollout", "RolloutGroup", "RoutedTurn", "TrainingSequence", "TurnRecord"]

# Sampler log-probs are log-probabilities, so <= 0; allow float noise from the server's fp16/bf16 math.
_LOGPROB_SLACK = 1e-3


def _check_len(problems: list[str], name: str, values: Any, expected: int, expected_name: str) -> None:
    if values is not None and len(values) != expected:
        problems.append(f"{name} has {len(values)} entries but {expected_name} has {expected}")


def _raise(kind: str, problems: list[str]) -> None:
    if problems:
        raise ValueError(f"invalid {kind}: " + "; ".join(problems))


@dataclass
class TurnRecord:
    """One sampling request: the prompt sent to the sampler and the tokens it produced.

    Invariants (checked by `validate`): `output_log_probs` has one entry per `output_ids` token whenever any
    output token is trained; `output_mask`, `output_sampling_mask` and `output_sampler_logprobs`, when given,
    have one entry per `output_ids` token; a non-empty candidate set contains its sampled token.

    Args:
        prompt_ids: Token ids of the whole prompt sent in this turn, all earlier turns of the conversation included.
        output_ids: Token ids the sampler generated.
        output_log_probs: Sampler (processed) log-probability of each token of `output_ids`. Required when any of
            them is trained.
        output_mask: One value per `output_ids` token: 1 trains the token, 0 keeps it as context only. `None`
            trains every output token.
        output_sampling_mask: One list per `output_ids` token: the token ids the sampler could draw from under the
            top_k / top_p cut-off. `None` means the full vocabulary.
        output_sampler_logprobs: One dict per `output_ids` token: the log-probabilities of the sampler's most likely
            tokens, keyed by token id. Used by score centering (`num_sampler_logprobs`).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None
    output_sampling_mask: list[list[int]] | None = None
    output_sampler_logprobs: list[dict[int, float]] | None = None

    @property
    def trains_any(self) -> bool:
        """Whether at least one output token is trained."""
        if not self.output_ids:
            return False
        return self.output_mask is None or any(self.output_mask)

    def validate(self) -> None:
        """Raise `ValueError` listing every broken invariant."""
        problems: list[str] = []
        n = len(self.output_ids)
        if self.trains_any or self.output_log_probs:
            _check_len(problems, "output_log_probs", self.output_log_probs, n, "output_ids")
        _check_len(problems, "output_mask", self.output_mask, n, "output_ids")
        _check_len(problems, "output_sampling_mask", self.output_sampling_mask, n, "output_ids")
        _check_len(problems, "output_sampler_logprobs", self.output_sampler_logprobs, n, "output_ids")
        if self.output_mask is not None and any(m not in (0, 1) for m in self.output_mask):
            problems.append("output_mask values must be 0 or 1")
        if any(not math.isfinite(lp) or lp > _LOGPROB_SLACK for lp in self.output_log_probs):
            problems.append("output_log_probs must be finite log-probabilities (<= 0)")
        if self.output_sampling_mask is not None and len(self.output_sampling_mask) == n:
            for i, (tok, cand) in enumerate(zip(self.output_ids, self.output_sampling_mask)):
                if cand and tok not in cand:
                    problems.append(f"output_sampling_mask[{i}] does not contain the sampled token {tok}")
                    break
        problems += self._extra_problems()
        _raise("TurnRecord", problems)

    def _extra_problems(self) -> list[str]:
        return []


@dataclass
class RoutedTurn(TurnRecord):
    """A `TurnRecord` with the sampler's MoE routing (routing replay, `router_replay`).

    Invariants (checked by `validate`, beside the turn's own): `routed_experts_start` lies in
    [0, len(prompt_ids)]; `routed_experts`, when given, has one row per token from `routed_experts_start` to the
    last output token, excluded.

    Args:
        routed_experts: The expert ids the sampler's routers chose, `[n, layers, top_k]` for tokens
            `routed_experts_start ... routed_experts_start + n - 1` of `prompt_ids + output_ids` (the server's
            `routed_experts`; the last output token was never forwarded and has no row). `None`: no routing.
        routed_experts_start: The request's `routed_experts_prompt_start`: prompt tokens before it have no row here
            (an earlier turn of the conversation holds theirs).
    """

    routed_experts: np.ndarray | None = None
    routed_experts_start: int = 0

    def _extra_problems(self) -> list[str]:
        problems = []
        if not 0 <= self.routed_experts_start <= len(self.prompt_ids):
            problems.append(f"routed_experts_start={self.routed_experts_start} is outside [0, len(prompt_ids)]")
        if self.routed_experts is not None:
            rows = len(self.prompt_ids) + len(self.output_ids) - 1 - self.routed_experts_start
            if self.routed_experts.ndim != 3 or len(self.routed_experts) != rows:
                problems.append(f"routed_experts {self.routed_experts.shape} must be [{rows}, layers, top_k]: one row "
                                "per token from routed_experts_start to the last output token, excluded")  # fmt: skip
        return problems


def _new_rollout_id() -> str:
    """16 random hex digits (64 bits, like the first half of a uuid4 without its object: one per rollout)."""
    return os.urandom(8).hex()


@dataclass
class Rollout:
    """One finished rollout returned by `generate_one()`: a whole conversation for one prompt.

    Args:
        completion: Messages generated after the prompt, in conversational format; passed to the reward functions
            as `completions`.
        completion_ids: Token ids of the generated completion; passed to the reward functions as `completion_ids`.
        turns: The sampling requests that produced the rollout, in order. Training sequences are built from them:
            sampled tokens are trained, the rest of each prompt is context.
        tool_call_count: Number of tool calls made during the rollout.
        tool_failure_count: Number of tool calls that failed.
        reward: A reward computed during generation (e.g. by an external judge), added to the reward functions'
            and the environment's. `None`: this source does not score the rollout.
        rollout_id: Identifies the rollout in training rows, for debugging. Defaults to a fresh random hex id.
    """

    completion: list[dict[str, Any]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=_new_rollout_id)

    def validate(self) -> None:
        """Raise `ValueError` if a turn is broken or the counts are inconsistent."""
        problems: list[str] = []
        if self.tool_call_count < 0 or self.tool_failure_count < 0:
            problems.append("tool counts must be >= 0")
        if self.tool_failure_count > self.tool_call_count:
            problems.append(
                f"tool_failure_count ({self.tool_failure_count}) exceeds tool_call_count ({self.tool_call_count})"
            )
        if self.reward is not None and not isinstance(self.reward, (int, float)):
            problems.append(f"reward must be a float or None, got {type(self.reward).__name__}")
        for i, turn in enumerate(self.turns):
            try:
                turn.validate()
            except ValueError as exc:
                problems.append(f"turns[{i}]: {exc}")
        _raise("Rollout", problems)


@dataclass
class TrainingSequence:
    """One training sample: a token sequence with the per-token data the loss needs.

    All per-token lists are aligned with `input_ids`: entry `i` describes token `input_ids[i]`, which the model
    predicts at position `i - 1`. Hence `loss_mask[0] == 0`.

    Invariants (checked by `validate`):
        - `loss_mask`, `sampler_logprobs` and, when given, `sampler_top_ids`, `sampler_top_logprobs` and
          `candidate_sets` have `len(input_ids)` entries;
        - `loss_mask` holds 0/1 and its first entry is 0;
        - at trained positions `sampler_logprobs` is a finite log-probability (<= 0); elsewhere it is ignored (0.0);
        - `sampler_top_ids[i]` and `sampler_top_logprobs[i]` have equal lengths (empty where untrained), are the
          sampler's most likely tokens at that position, and their log-probs are finite; or the two are
          `[len(input_ids), K]` numpy arrays padded with id -1 / log-prob -inf (what reconciliation builds from
          the client's array-backed answers: no per-token Python objects);
        - a non-empty `candidate_sets[i]` (top-k/top-p set the token was drawn from) contains `input_ids[i]`; an
          empty one means the full vocabulary;
        - `routed_experts`, when given, is an int16 `[len(input_ids), layers, top_k]` array, -1 where the sampler
          gave no routing (every id of such a row is -1).

    Args:
        input_ids: Prompt, completion and tool tokens of the sample.
        loss_mask: 1 where the token is trained (sampled by the policy), 0 for context.
        sampler_logprobs: Sampler's processed log-prob of each trained token (the old policy, L1).
        advantage: The rollout's advantage; every trained token of the sample carries it.
        model_version: Policy version that sampled the rollout (the group's version at its first rollout).
        group_id: Group the rollout belongs to (tree packing puts a group's samples on the same row).
        row_index: Dataset row index of the prompt (checkpoint/resume and epoch accounting).
        sampler_top_ids: Per position, ids of the sampler's most likely tokens (score centering).
        sampler_top_logprobs: Per position, their sampler log-probs.
        candidate_sets: Per position, the candidate set of the sampled token under top-k/top-p (G9).
        rollout_id: The rollout this sample came from (debugging; several samples share it after a fork).
        routed_experts: Per position, the experts the sampler's MoE routers chose for the token (routing replay:
            `router_replay`); rows of -1 are routed by the trainer's own routers.
    """

    input_ids: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float]
    advantage: float
    model_version: int
    group_id: int
    row_index: int
    sampler_top_ids: list[list[int]] | np.ndarray | None = None
    sampler_top_logprobs: list[list[float]] | np.ndarray | None = None
    candidate_sets: list[list[int]] | None = None
    rollout_id: str = ""
    routed_experts: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        """Tokens forwarded for this sample (before prefix sharing)."""
        return len(self.input_ids)

    @property
    def num_trained_tokens(self) -> int:
        """Tokens the loss is computed on."""
        return int(sum(self.loss_mask))

    def validate(self) -> None:
        """Raise `ValueError` listing every broken invariant."""
        problems: list[str] = []
        n = len(self.input_ids)
        for name in ("loss_mask", "sampler_logprobs", "sampler_top_ids", "sampler_top_logprobs", "candidate_sets"):
            _check_len(problems, name, getattr(self, name), n, "input_ids")
        if (self.sampler_top_ids is None) != (self.sampler_top_logprobs is None):
            problems.append("sampler_top_ids and sampler_top_logprobs must be given together")
        if not set(self.loss_mask) <= {0, 1}:
            problems.append("loss_mask values must be 0 or 1")
        elif self.loss_mask and self.loss_mask[0] != 0:
            problems.append("loss_mask[0] must be 0: the first token has no position predicting it")
        if not math.isfinite(self.advantage):
            problems.append(f"advantage must be finite, got {self.advantage}")
        r = self.routed_experts
        if r is not None and not (isinstance(r, np.ndarray) and r.dtype == np.int16 and r.ndim == 3 and len(r) == n):
            problems.append(f"routed_experts must be an int16 [len(input_ids)={n}, layers, top_k] array")
        if problems:  # the per-position checks below assume aligned lengths
            _raise("TrainingSequence", problems)
        if self._positions_look_valid():
            return
        for i, trained in enumerate(self.loss_mask):
            if trained and not (math.isfinite(self.sampler_logprobs[i]) and self.sampler_logprobs[i] <= _LOGPROB_SLACK):
                problems.append(f"sampler_logprobs[{i}]={self.sampler_logprobs[i]} is not a log-probability")
                break
        if self.sampler_top_ids is not None and self.sampler_top_logprobs is not None:
            for i, (ids, lps) in enumerate(zip(*_ragged_top(self.sampler_top_ids, self.sampler_top_logprobs))):
                if len(ids) != len(lps):
                    problems.append(f"sampler_top_ids[{i}] and sampler_top_logprobs[{i}] differ in length")
                    break
                if any(not math.isfinite(lp) or lp > _LOGPROB_SLACK for lp in lps):
                    problems.append(f"sampler_top_logprobs[{i}] holds a value that is not a log-probability")
                    break
        arrays = isinstance(self.sampler_top_ids, np.ndarray) or isinstance(self.sampler_top_logprobs, np.ndarray)
        if arrays and not problems and not _top_arrays_look_valid(self.sampler_top_ids, self.sampler_top_logprobs):
            problems.append("sampler_top_ids / sampler_top_logprobs as arrays must both be [len(input_ids), K] with "
                            "id -1 exactly where the log-prob is -inf (padding)")  # fmt: skip
        if self.candidate_sets is not None:
            for i, cand in enumerate(self.candidate_sets):
                if cand and self.loss_mask[i] and self.input_ids[i] not in cand:
                    problems.append(f"candidate_sets[{i}] does not contain the token {self.input_ids[i]}")
                    break
        _raise("TrainingSequence", problems)

    def _positions_look_valid(self) -> bool:
        """The per-position checks of ``validate`` as whole-list passes in C (the rollout worker runs this on
        every sample); False sends ``validate`` through its position loop, which names the first bad index."""
        trained = list(compress(self.sampler_logprobs, self.loss_mask))
        if not (all(map(math.isfinite, trained)) and max(trained, default=0.0) <= _LOGPROB_SLACK):
            return False
        ids, lps = self.sampler_top_ids, self.sampler_top_logprobs
        if isinstance(ids, np.ndarray) or isinstance(lps, np.ndarray):
            if not _top_arrays_look_valid(ids, lps):
                return False
        elif ids is not None and lps is not None:
            if list(map(len, ids)) != list(map(len, lps)):
                return False
            top = list(chain.from_iterable(lps))
            if not (all(map(math.isfinite, top)) and max(top, default=0.0) <= _LOGPROB_SLACK):
                return False
        return self.candidate_sets is None or not any(self.candidate_sets)


def _top_arrays_look_valid(ids: Any, lps: Any) -> bool:
    """``[L, K]`` top-N arrays: same shape, padding (id -1) exactly where the log-prob is -inf, the rest finite
    log-probabilities."""
    if not (isinstance(ids, np.ndarray) and isinstance(lps, np.ndarray) and ids.ndim == 2 and ids.shape == lps.shape):
        return False
    # Once the padding is exactly the -inf entries, one comparison over the whole array checks the rest: -inf
    # padding passes it, and NaN or +inf (not finite) fails it like a positive log-prob does.
    return bool(((ids >= 0) == (lps != -np.inf)).all() and (lps <= _LOGPROB_SLACK).all())


def _ragged_top(ids: Any, lps: Any) -> tuple[list[Any], list[Any]]:
    """Top-N per position as ragged lists; ``[L, K]`` arrays drop their padding (id -1 and log-prob -inf)."""
    if not (isinstance(ids, np.ndarray) and isinstance(lps, np.ndarray) and ids.shape == lps.shape):
        return list(ids), list(lps)
    pad = (ids < 0) & (lps == -np.inf)
    return [r[~p].tolist() for r, p in zip(ids, pad)], [r[~p].tolist() for r, p in zip(lps, pad)]


@dataclass
class RolloutGroup:
    """The `num_generations` rollouts of one prompt, scored together. Each list has one entry per rollout.

    Args:
        prompts: Prompt of each rollout.
        reward_kwargs: Other columns of the prompt's dataset row, passed to the reward functions as keywords.
        completions: Completion messages of each rollout.
        completions_ids: Completion token ids of each rollout.
        completions_sequences: Training sequences built from each rollout; a rollout whose re-tokenised history
            changed between turns yields more than one.
        tool_call_counts: Tool calls of each rollout.
        tool_failure_counts: Failed tool calls of each rollout.
        model_version: Policy version when the group's first rollout started.
        group_id: Identifier of the group, counted from 0 over the run.
        row_index: Row index of the prompt in the training dataset.
        env_rewards: For rollouts with an environment defining `get_reward`, that environment's class and its
            reward; otherwise `None`.
        rollout_rewards: `.reward` of each `Rollout`.
        queued_at: `time.monotonic()` when the group was queued for scoring.
        rewards: Total reward of each rollout, summed over all reward sources; NaN where no source scored it. Set
            before `compute_advantages()` is called.
    """

    prompts: list[list[dict[str, Any]]]
    reward_kwargs: dict[str, list[Any]]
    completions: list[list[dict[str, Any]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    row_index: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.completions)

    def validate(self) -> None:
        """Raise `ValueError` if the per-rollout lists disagree in length."""
        problems: list[str] = []
        g = len(self.completions)
        for name in (
            "prompts",
            "completions_ids",
            "completions_sequences",
            "tool_call_counts",
            "tool_failure_counts",
            "env_rewards",
            "rollout_rewards",
        ):
            _check_len(problems, name, getattr(self, name), g, "completions")
        for key, values in self.reward_kwargs.items():
            _check_len(problems, f"reward_kwargs[{key!r}]", values, g, "completions")
        if self.rewards is not None:
            _check_len(problems, "rewards", self.rewards, g, "completions")
        _raise("RolloutGroup", problems)

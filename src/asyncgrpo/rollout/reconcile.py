"""Turn a rollout's sampling requests into training sequences (A5).

A turn whose prompt starts with the tokens already held (the previous prompt
plus what was sampled) extends the same sequence: its new prompt tokens (tool
results, template glue) become context and its sampled tokens are trained. A
turn whose prompt does not (the chat template re-rendered history differently)
closes the held sequence and starts a new one — a *fork*. Every sampled token
is trained in exactly one sequence; a single-turn rollout yields one sequence,
``prompt + completion``.

With ``fork_threshold_tokens`` > 0 (TRL 1.16's field), a turn whose prompt differs from the held tokens only
inside the previous answer, by fewer tokens than the threshold, *realigns* instead: the drifted answer tokens
are overwritten by the new prompt's as context (no longer trained) and the sequence goes on. 0 always forks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np

from asyncgrpo.client.results import TopLogprobs
from asyncgrpo.metrics import MetricEvent
from asyncgrpo.types import Rollout, TrainingSequence, TurnRecord

_first, _by_logprob = itemgetter(0), itemgetter(1)  # C key functions: this runs once per generated token


@dataclass
class _Held:
    """The sequence being built. Per-token Python objects are made only where the sequence needs them: top-N
    entries and candidate sets stay as per-turn blocks until :meth:`top_n` / :meth:`candidates` (a 256-token
    prompt would otherwise cost 256 empty candidate lists and a padding block per sequence)."""

    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[tuple[int, Any]] = field(default_factory=list)  # (positions, their top log-probs or None)
    masks: list[tuple[int, Any]] = field(default_factory=list)  # (positions, their candidate sets or None)
    trained: bool = False  # any output token trained (context tokens never are)
    answer_start: int | None = None  # where the last added answer begins (a realign may only cut inside it)
    routed: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (first position, [n, layers, top_k] ids)

    def add_context(self, ids: list[int]) -> None:
        n = len(ids)
        self.ids += ids
        self.mask += [0] * n
        self.logprobs += [0.0] * n
        self.tops.append((n, None))
        self.masks.append((n, None))

    def add_output(self, turn: TurnRecord) -> None:
        """Append a turn's sampled tokens; whole-list operations, no per-token method calls."""
        self.answer_start = len(self.ids)
        n = len(turn.output_ids)
        self.ids += turn.output_ids
        mask = list(turn.output_mask) if turn.output_mask is not None else [1] * n
        self.trained = self.trained or any(mask)
        self.mask += mask
        self.logprobs += list(turn.output_log_probs) if turn.output_log_probs else [0.0] * n
        self.tops.append((n, turn.output_sampler_logprobs))
        self.masks.append((n, turn.output_sampling_mask))
        routed = getattr(turn, "routed_experts", None)  # a RoutedTurn's (types.py); plain turns carry none
        if routed is not None:  # the turn's prompt starts with the held tokens: same positions
            self.routed.append((getattr(turn, "routed_experts_start", 0), routed))

    def routing(self) -> np.ndarray | None:
        """Per position the sampler's expert ids, int16 ``[L, layers, top_k]``, -1 where no turn routed the token.

        A token routed by two turns (a prompt re-sent without ``routed_experts_prompt_start``) keeps the first
        turn's routing: the tokens sampled right after it were drawn with that one.
        """
        if not self.routed:
            return None
        shape = self.routed[0][1].shape[1:]
        out = np.full((len(self.ids), *shape), -1, dtype=np.int16)
        filled = np.zeros(len(self.ids), dtype=bool)
        for start, rows in self.routed:
            if rows.shape[1:] != shape:
                raise ValueError(f"routed_experts of one rollout differ in shape: {rows.shape[1:]} vs {shape}")
            end = min(start + len(rows), len(self.ids))
            take = ~filled[start:end]
            out[start:end][take] = rows[: end - start][take]
            filled[start:end] = True
        return out

    def cut_answer(self, keep: int) -> None:
        """Keep the first ``keep`` tokens, cutting only inside the last answer (a realign drops its drifted tail)."""
        assert self.answer_start is not None and keep >= self.answer_start
        drop = len(self.ids) - keep
        del self.ids[keep:], self.mask[keep:], self.logprobs[keep:]
        for blocks in (self.tops, self.masks):  # the last block is the answer's
            n, data = blocks[-1]
            blocks[-1] = (n - drop, _head(data, n - drop))
        self.trained = any(self.mask)

    def candidates(self) -> list[list[int]] | None:
        """Per position the candidate set (empty: the full vocabulary); None when no position has one."""
        if all(m is None for _, m in self.masks):
            return None
        out: list[list[int]] = []
        for n, m in self.masks:
            out += [list(c) if c else [] for c in m] if m is not None else [[] for _ in range(n)]
        return out if any(out) else None

    def top_n(self, top_n: int) -> tuple[Any, Any]:
        """Per position the ``top_n`` best sampler entries, best first (ties in the answer's order).

        As ``[L, top_n]`` arrays padded with id -1 / log-prob -inf when every turn's came as arrays
        (:class:`TopLogprobs`, what the client parses from ``/v1/completions``): no per-token Python
        objects. Otherwise ragged lists (empty where there are none), from per-position dicts.
        """
        given = [(n, t) for n, t in self.tops if t is not None]
        if given and all(isinstance(t, TopLogprobs) for _, t in given):
            if all(len(t) == n for n, t in given):
                ids = np.full((len(self.ids), top_n), -1, dtype=np.int32)
                logprobs = np.full((len(self.ids), top_n), -np.inf, dtype=np.float32)
                start = 0
                for n, t in self.tops:
                    if t is not None and n:
                        ids[start : start + n], logprobs[start : start + n] = t.best(top_n)
                    start += n
                return ids, logprobs
            # A turn whose top-N count differs from its tokens: laid end to end, validate() names the mismatch.
            blocks = [_padding(n, top_n) if t is None else t.best(top_n) for n, t in self.tops]
            return (np.concatenate([b[0] for b in blocks]).astype(np.int32),
                    np.concatenate([b[1] for b in blocks]).astype(np.float32))  # fmt: skip
        ids_rows: list[list[int]] = []
        logprob_rows: list[list[float]] = []
        for n, t in self.tops:
            if t is None:
                ids_rows += [[] for _ in range(n)]
                logprob_rows += [[] for _ in range(n)]
                continue
            bests = [sorted(d.items(), key=_by_logprob, reverse=True)[:top_n] for d in t]
            ids_rows += [list(map(_first, b)) for b in bests]
            logprob_rows += [list(map(_by_logprob, b)) for b in bests]
        return ids_rows, logprob_rows


def _head(data: Any, k: int) -> Any:
    """The first ``k`` per-token entries of a block (None, a list, or the client's ``TopLogprobs`` arrays)."""
    if data is None:
        return None
    if isinstance(data, TopLogprobs):
        return TopLogprobs(data.ids[:k], data.values[:k], data.counts[:k], data.sortable)
    return list(data)[:k]


def _padding(n: int, top_n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full((n, top_n), -1, dtype=np.int64), np.full((n, top_n), -np.inf, dtype=np.float64)


@dataclass
class ReconcileStats:
    """Fork bookkeeping for ``rollout/fork_frac`` and ``rollout/drift_tokens_*``."""

    transitions: int = 0
    forks: int = 0
    realigns: int = 0  # transitions that overwrote a short drift inside the last answer (fork_threshold_tokens)
    drift_tokens: list[int] = field(default_factory=list)  # one entry per transition, 0 when it extended

    def metric_events(self, num_sequences: int, num_rollouts: int) -> list[MetricEvent]:
        """``rollout/samples_per_rollout``, ``rollout/fork_frac`` and ``rollout/drift_tokens_*`` of these rollouts.

        Means are weighted by what they average over (rollouts, turn transitions), so a logging window
        reports the mean over all its rollouts and transitions. Without a transition (single-turn rollouts)
        there is nothing to average the fork metrics over and they are left out.
        """
        if num_rollouts <= 0:
            raise ValueError(f"num_rollouts must be > 0, got {num_rollouts}")
        events: list[MetricEvent] = [("rollout/samples_per_rollout", num_sequences / num_rollouts, float(num_rollouts))]
        if self.transitions:
            n = float(self.transitions)
            events.append(("rollout/fork_frac", self.forks / n, n))
            events.append(("rollout/drift_tokens_mean", sum(self.drift_tokens) / n, n))
            events.append(("rollout/drift_tokens_max", float(max(self.drift_tokens)), 1.0))
        return events


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def rollout_to_sequences(
    rollout: Rollout,
    *,
    group_id: int,
    row_index: int,
    model_version: int,
    num_sampler_logprobs: int | None,
    stats: ReconcileStats | None = None,
    fork_threshold_tokens: int = 0,
) -> list[TrainingSequence]:
    """Training sequences of one rollout, advantage 0.0 (set after scoring).

    Args:
        num_sampler_logprobs: keep this many sampler top log-probs per trained token (None/0: none).
        fork_threshold_tokens: realign (see the module docstring) drifts inside the last answer shorter than this.
    """
    stats = stats if stats is not None else ReconcileStats()
    out: list[TrainingSequence] = []
    held = _Held()

    def emit() -> None:
        if held.trained:
            top_ids, top_logprobs = held.top_n(num_sampler_logprobs) if num_sampler_logprobs else (None, None)
            out.append(
                TrainingSequence(
                    input_ids=held.ids,
                    loss_mask=held.mask,
                    sampler_logprobs=held.logprobs,
                    advantage=0.0,
                    model_version=model_version,
                    group_id=group_id,
                    row_index=row_index,
                    sampler_top_ids=top_ids,
                    sampler_top_logprobs=top_logprobs,
                    candidate_sets=held.candidates(),
                    rollout_id=rollout.rollout_id,
                    routed_experts=held.routing(),
                )
            )

    for turn in rollout.turns:
        if held.ids:
            stats.transitions += 1
            if turn.prompt_ids[: len(held.ids)] == held.ids:
                held.add_context(turn.prompt_ids[len(held.ids) :])
                held.add_output(turn)
                stats.drift_tokens.append(0)
                continue
            matched = _common_prefix(held.ids, turn.prompt_ids)
            drift = len(held.ids) - matched
            stats.drift_tokens.append(drift)
            if held.answer_start is not None and matched >= held.answer_start and drift < fork_threshold_tokens:
                stats.realigns += 1
                held.cut_answer(matched)
                held.add_context(turn.prompt_ids[matched:])
                held.add_output(turn)
                continue
            stats.forks += 1
            emit()
            held = _Held()
        if not turn.prompt_ids:
            raise ValueError("a turn has an empty prompt; every sampling request needs at least one prompt token")
        held.add_context(list(turn.prompt_ids))
        held.add_output(turn)
    emit()
    return out

"""Dynamic sampling: what fills an optimizer step when groups whose rewards all tie carry no signal (R5, issue 36).

A group whose rewards all tie has zero advantage everywhere: it is dropped from the loss in both modes (R5). The
switch ``dynamic_sampling`` says what takes its place in the step's token budget:

* on (the default, the reference document's R5, DAPO's dynamic sampling): the tied group takes no room; the step
  keeps filling with groups that have a signal up to its budget, so steps stay full. The over-sampling is capped:
  once a step has pulled more than ``dynamic_sampling_max_factor`` groups per kept group (with at least one kept),
  it stops filling and trains what it holds (a smaller step), with one line saying so and what to change
  (``dynamic_sampling/cap_hit`` = 1). With none kept it keeps pulling; ``ZERO_STD_PATIENCE_GROUPS`` tied groups in
  a row still stop the run with its diagnosis.
* off (TRL without DAPO): no over-sampling. A step takes groups as generated until the *generated* samples fill its
  budget; a tied group takes its room (``GroupResult.row_tokens``, its samples as a row would forward them) and is
  not replaced, so the step trains fewer samples. A step whose whole budget tied trains nothing; it keeps pulling
  until a group with a signal comes (the step counts every group it pulled).

Either way over-sampled work counts whole against the token-based staleness admission (G3; a dropped group frees
its tokens when it ends, and the trainer's 30 s wait lines say what a step waits for). (An admission that counted
in-flight groups at their expected kept share, so as to over-sample ahead, was measured on the demo and removed:
its overshoot landed past ``max_staleness``, 70 samples dropped as stale in one step against none.)

``OverSamplingCount`` counts, per optimizer step, the scored groups the step pulled against those kept (the
``dynamic_sampling/*`` metrics, logged in both modes: with the switch off ``generated_per_kept`` is the natural tie
rate) and says when the cap stops a step. ``row_tokens`` is the worker's measure of a tied group's room.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncgrpo.packing.sample import PackSample
from asyncgrpo.packing.trie import PrefixTrie

DYNAMIC_SAMPLING_METRICS: dict[str, str] = {
    "dynamic_sampling/generated_groups": "scored groups the step pulled from the worker (kept and dropped for ties)",
    "dynamic_sampling/kept_groups": "of those, groups with non-zero reward variance (trained now, or held for the next step)",
    "dynamic_sampling/generated_per_kept": "groups generated per kept group in the step (the over-sampling factor; "
    "with dynamic_sampling off, the tie rate's inverse)",
    "dynamic_sampling/cap_hit": "1 when the step stopped filling at dynamic_sampling_max_factor and trained a smaller "
    "step, else 0",
}


@dataclass
class OverSamplingCount:
    """Groups generated and kept in one optimizer step; ``close_step`` hands out its metrics and starts the next.

    Args:
        max_factor: the cap on generated groups per kept group (``dynamic_sampling_max_factor``).
        enforce_cap: whether the cap stops a step (``dynamic_sampling`` on); off, the step is never over the cap.
    """

    max_factor: float
    enforce_cap: bool = True
    generated: int = 0
    kept: int = 0
    cap_hit: bool = False

    def __post_init__(self) -> None:
        if self.max_factor < 1:
            raise ValueError(f"dynamic_sampling_max_factor must be >= 1, got {self.max_factor}")

    @property
    def factor(self) -> float:
        """Generated per kept group (inf: none kept yet; NaN: nothing generated)."""
        if self.generated == 0:
            return math.nan
        return self.generated / self.kept if self.kept else math.inf

    def on_group(self, kept: bool) -> None:
        """Count one scored group (kept: it has a signal and samples to train)."""
        self.generated += 1
        self.kept += int(kept)

    @property
    def over_cap(self) -> bool:
        """The step should stop filling: ``generated > max_factor × kept`` with at least one kept (cap enforced)."""
        return self.enforce_cap and self.kept >= 1 and self.generated > self.max_factor * self.kept

    def stop(self, step: int, held_samples: int) -> str:
        """Record that the cap stopped step ``step`` (holding ``held_samples`` samples); returns the line to print."""
        self.cap_hit = True
        return (
            f"step {step}: dynamic sampling stopped filling the step: {self.generated} groups generated for "
            f"{self.kept} kept, over dynamic_sampling_max_factor={self.max_factor:g}; it trains the {held_samples} "
            "samples it holds (a smaller step, see batch/trained_tokens_per_step). Most prompts score the same on "
            "every sample: prompt pools (prompt_pools=True), a dataset matched to the model, or a reward with "
            "partial credit give more signal; a larger dynamic_sampling_max_factor fills the step anyway"
        )

    def close_step(self) -> list[tuple[str, float]]:
        """The step's metrics, then zero counts for the next step."""
        factor = self.factor
        out = [
            ("dynamic_sampling/generated_groups", float(self.generated)),
            ("dynamic_sampling/kept_groups", float(self.kept)),
        ]
        if math.isfinite(factor):
            out.append(("dynamic_sampling/generated_per_kept", factor))
        out.append(("dynamic_sampling/cap_hit", float(self.cap_hit)))
        self.generated = self.kept = 0
        self.cap_hit = False
        return out


def row_tokens(sequences: Sequence[Any]) -> int:
    """Tokens a row forwards for these samples (``TrainingSequence``s; shared prefixes once, as the planner counts).

    The worker sends a tied group's size this way instead of its samples: with dynamic sampling off it is the
    room the group takes in its step.
    """
    trie = PrefixTrie()
    flat = 0
    for s in sequences:
        ids = np.asarray(s.input_ids, dtype=np.int64)
        try:
            trie.insert(PackSample(ids, s.loss_mask, np.zeros(len(ids), dtype=np.float32), 0.0, 0))
        except ValueError:  # a malformed sample (empty, or trained first token): counted as its own chain
            flat += len(ids)
    return trie.num_tokens + flat

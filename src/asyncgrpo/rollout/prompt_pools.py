"""Difficulty-aware prompt pools: which prompt to generate next, from each prompt's running pass rate (issue 36).

In an asynchronous trainer a prompt's difficulty is known only once its group returns, so the pools live beside
the rollout worker's prompt order and learn from every returned group:

* each prompt keeps a running pass rate, an exponential moving average of its groups' pass fractions (the first
  group sets it);
* prompts never returned yet sit in the ``new`` pool; the others fall into pools cut at ``thresholds`` (hardest
  first), and each draw picks a pool by its weight among the non-empty ones, then a prompt in it at random;
* a prompt whose rate reaches ``retire_at`` (after ``min_groups`` groups) is *retired*: solved, never drawn again;
* a prompt whose rate is 0 (nothing solved) is *parked* for ``requeue_delay`` draws, then eligible again;
* a prompt is not drawn while its group is in flight (unless the caller cannot wait: ``next_prompt(force=True)``);
* a pool of weight 0 is drawn only when no weighted pool has an eligible prompt (so the run never stalls on it).

Everything a draw depends on (the rates, the parked prompts, the draw count, the random generator) is in
``state_dict``, which is plain JSON, so a loaded state draws exactly what the saved one would have. In a run the
checkpoint saves the trainer's copy, which learns only from settled groups (``trainer/data_accounting.py``), and the
resumed worker starts from it (``worker_pools``). When nothing is eligible but prompts are parked and none is in
flight, the earliest parked one is released at once: a draw never waits for results that cannot come.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

NEW_POOL = "new"
POOL_METRICS: dict[str, str] = {
    "pools/{pool}/size": "prompts in the pool (new, hard, medium, easy with the default cuts) at the step's end",
    "pools/{pool}/pass_rate": "mean running pass rate of the pool's prompts (NaN while none has returned)",
    "pools/retired": "prompts retired as solved so far",
    "pools/parked": "unsolved prompts waiting out prompt_pool_requeue_delay",
}


@dataclass(frozen=True)
class PoolSettings:
    """How prompts are pooled; the config's ``prompt_pool_*`` fields (``config_data.py``).

    Args:
        thresholds: ascending pass-rate cuts in (0, 1); ``len(thresholds) + 1`` pools, hardest first.
        weights: one sampling weight per pool of ``names`` (``new`` first), >= 0.
        retire_at: a prompt whose running pass rate reaches this is retired (> 1: never).
        min_groups: groups a prompt needs before it can be retired.
        requeue_delay: draws an unsolved prompt (rate 0) waits before it can be drawn again.
        ema: weight of the newest group in the running pass rate (1.0: the last group alone).
        seed: the draws' random seed.
    """

    thresholds: tuple[float, ...] = (0.2, 0.8)
    weights: tuple[float, ...] = (1.0, 1.0, 2.0, 1.0)
    retire_at: float = 1.0
    min_groups: int = 2
    requeue_delay: int = 64
    ema: float = 0.5
    seed: int = 0

    @property
    def names(self) -> tuple[str, ...]:
        """``new``, then the pools from the lowest pass rate up (``hard``/``easy`` for one cut, ``hard``/``medium``/
        ``easy`` for two, ``pool0``... otherwise)."""
        n = len(self.thresholds) + 1
        named = {2: ("hard", "easy"), 3: ("hard", "medium", "easy")}
        rated = named.get(n) or tuple(f"pool{i}" for i in range(n))
        return (NEW_POOL, *rated)

    def problems(self) -> list[str]:
        """What is wrong with these settings, each with its fix (empty when they are usable)."""
        out = []
        t = list(self.thresholds)
        if any(not 0 < x < 1 for x in t) or t != sorted(set(t)):
            out.append(f"prompt_pool_thresholds={t}: give ascending pass rates strictly between 0 and 1")
        if len(self.weights) != len(t) + 2:
            out.append(
                f"prompt_pool_weights has {len(self.weights)} weights but the pools are {len(t) + 2} "
                f"({', '.join(self.names)}): give one weight per pool, 'new' first"
            )
        if any(w < 0 for w in self.weights) or not any(w > 0 for w in self.weights):
            out.append(f"prompt_pool_weights={list(self.weights)}: weights must be >= 0 and one of them > 0")
        if not 0 < self.ema <= 1:
            out.append(f"prompt_pool_ema={self.ema}: the newest group's weight must be in (0, 1]")
        if self.min_groups < 1 or self.requeue_delay < 0:
            out.append(
                f"prompt_pool_min_groups={self.min_groups}, prompt_pool_requeue_delay={self.requeue_delay}: "
                "need min_groups >= 1 and requeue_delay >= 0"
            )
        return out


class PromptPools:
    """Draws prompt indices of a dataset of ``num_prompts`` rows by difficulty (see the module docstring)."""

    def __init__(self, num_prompts: int, settings: PoolSettings) -> None:
        problems = settings.problems()
        if problems:
            raise ValueError("; ".join(problems))
        if num_prompts < 1:
            raise ValueError("prompt pools need a dataset with at least one prompt (and a length)")
        self.n = num_prompts
        self.s = settings
        self.rng = random.Random(settings.seed)
        self.rate: dict[int, float] = {}  # prompt -> running pass rate (returned prompts only)
        self.groups: dict[int, int] = {}  # prompt -> groups returned
        self.parked: dict[int, int] = {}  # prompt -> draw count at which it is eligible again
        self.retired: set[int] = set()
        self.in_flight: dict[int, int] = {}  # prompt -> its groups in flight (more than 1 only if forced)
        self.draws = 0

    # ---- drawing -------------------------------------------------------------------------------------------------
    def pool_of(self, prompt: int) -> str:
        if prompt not in self.rate:
            return NEW_POOL
        i = sum(self.rate[prompt] >= t for t in self.s.thresholds)
        return self.s.names[1 + i]

    def _eligible(self) -> dict[str, list[int]]:
        pools: dict[str, list[int]] = {name: [] for name in self.s.names}
        for p in range(self.n):
            if p in self.retired or p in self.in_flight:
                continue
            if p in self.parked and self.parked[p] > self.draws:
                continue
            pools[self.pool_of(p)].append(p)
        return pools

    def next_prompt(self, force: bool = False) -> int | None:
        """The next prompt to generate, or None: every prompt is in flight, retired or parked behind one in flight.

        ``exhausted`` tells the two cases of None apart: all retired (no more data), or wait for a group. With
        ``force`` (a caller that cannot wait, such as the worker's synchronous prompt iterator) a prompt in flight
        or parked is drawn again instead of None, evenly among those not retired.
        """
        pools = self._eligible()
        if not any(pools.values()) and self.parked and not self.in_flight:
            first = min(self.parked, key=lambda p: (self.parked[p], p))  # nothing can return: release one now
            self.parked[first] = self.draws
            pools = self._eligible()
        names = [name for name in self.s.names if pools[name]]
        if not names and force and not self.exhausted:
            prompt = self.rng.choice([p for p in range(self.n) if p not in self.retired])
            return self._take(prompt)
        if not names:
            return None
        weights = [self.s.weights[self.s.names.index(name)] for name in names]
        if not any(w > 0 for w in weights):  # only weight-0 pools hold eligible prompts: they are drawn evenly
            weights = [1.0] * len(names)
        pool = self.rng.choices(names, weights=weights)[0]
        return self._take(pools[pool][self.rng.randrange(len(pools[pool]))])

    def _take(self, prompt: int) -> int:
        self.parked.pop(prompt, None)
        self.in_flight[prompt] = self.in_flight.get(prompt, 0) + 1
        self.draws += 1
        return prompt

    @property
    def exhausted(self) -> bool:
        """Every prompt is retired: the source has no more data."""
        return len(self.retired) == self.n

    # ---- learning from returned groups ---------------------------------------------------------------------------
    def on_group(self, prompt: int, pass_fraction: float | None) -> str:
        """A drawn prompt's group returned with this fraction of passing samples (None: not scored, e.g. skipped).

        Returns what became of the prompt: ``retired``, ``parked`` or its pool's name.
        """
        if prompt not in self.in_flight:
            raise ValueError(f"prompt {prompt} returned but was not drawn (or returned twice)")
        self.in_flight[prompt] -= 1
        if not self.in_flight[prompt]:
            del self.in_flight[prompt]
        return self.record(prompt, pass_fraction)

    def record(self, prompt: int, pass_fraction: float | None, count_draw: bool = False) -> str:
        """Learn from a group of ``prompt`` (``on_group`` without the in-flight check). The trainer's copy of the
        pools (``trainer/data_accounting.py``) records each group its steps settled with ``count_draw``: one draw
        each, so its delays run in settled groups; its state is what a checkpoint saves."""
        if not 0 <= prompt < self.n:
            raise ValueError(f"prompt {prompt} is not a row of the dataset's {self.n} prompts")
        if count_draw:
            self.draws += 1
        if pass_fraction is None:
            return self.pool_of(prompt)
        if not 0.0 <= pass_fraction <= 1.0:
            raise ValueError(f"pass_fraction must be in [0, 1], got {pass_fraction}")
        old = self.rate.get(prompt)
        self.rate[prompt] = pass_fraction if old is None else (1 - self.s.ema) * old + self.s.ema * pass_fraction
        self.groups[prompt] = self.groups.get(prompt, 0) + 1
        if self.rate[prompt] >= self.s.retire_at and self.groups[prompt] >= self.s.min_groups:
            self.retired.add(prompt)
            return "retired"
        if self.rate[prompt] == 0.0 and self.s.requeue_delay > 0:
            self.parked[prompt] = self.draws + self.s.requeue_delay
            return "parked"
        return self.pool_of(prompt)

    # ---- metrics and checkpoints ---------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``pools/<pool>/size`` and ``pools/<pool>/pass_rate`` (mean running rate; NaN when empty), retired and
        parked counts, in the order of ``names``."""
        out: dict[str, float] = {}
        for name in self.s.names:
            members = [p for p in range(self.n) if p not in self.retired and self.pool_of(p) == name]
            rates = [self.rate[p] for p in members if p in self.rate]
            out[f"pools/{name}/size"] = float(len(members))
            out[f"pools/{name}/pass_rate"] = sum(rates) / len(rates) if rates else float("nan")
        out["pools/retired"] = float(len(self.retired))
        out["pools/parked"] = float(sum(1 for p, at in self.parked.items() if at > self.draws))
        return out

    def state_dict(self) -> dict:
        """Plain JSON: everything the next draws depend on (in-flight prompts are not state: their groups
        are generated again after a resume, so they are eligible)."""
        version, internal, gauss = self.rng.getstate()
        return {
            "num_prompts": self.n,
            "draws": self.draws,
            "rate": {str(p): r for p, r in sorted(self.rate.items())},
            "groups": {str(p): g for p, g in sorted(self.groups.items())},
            "parked": {str(p): at for p, at in sorted(self.parked.items())},
            "retired": sorted(self.retired),
            "rng": [version, list(internal), gauss],
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["num_prompts"]) != self.n:
            raise ValueError(
                f"the pools' state was saved for {state['num_prompts']} prompts but the dataset has {self.n}: "
                "resume with the same dataset"
            )
        self.draws = int(state["draws"])
        self.rate = {int(p): float(r) for p, r in state["rate"].items()}
        self.groups = {int(p): int(g) for p, g in state["groups"].items()}
        self.parked = {int(p): int(at) for p, at in state["parked"].items()}
        self.retired = {int(p) for p in state["retired"]}
        self.in_flight = {}
        version, internal, gauss = state["rng"]
        self.rng.setstate((int(version), tuple(int(x) for x in internal), gauss))


def pass_fraction(rewards: Sequence[float], threshold: float) -> float | None:
    """Fraction of a group's rewards at or above ``threshold`` (NaN: unscored, left out); None if none scored."""
    scored = [r for r in rewards if not math.isnan(r)]
    return sum(r >= threshold for r in scored) / len(scored) if scored else None


def worker_pools(num_prompts: int, settings: PoolSettings, state: dict | None) -> PromptPools:
    """The rollout worker's pools: fresh, or the checkpoint's settled state with a generator seeded by it (the
    trainer's copy never draws, so its generator says nothing of the draws to come)."""
    pools = PromptPools(num_prompts, settings)
    if state is not None:
        pools.load_state_dict(state)
        pools.rng = random.Random(f"{settings.seed}/{pools.draws}")
    return pools

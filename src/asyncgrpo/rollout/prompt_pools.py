"""Difficulty-aware prompt pools: which prompt to generate next, from each prompt's running pass rate (issue 36).

In an asynchronous trainer a prompt's difficulty is known only once its group returns, so the pools live beside
the rollout worker's prompt order and learn from every returned group:

* each prompt keeps a running pass rate, an exponential moving average of its groups' pass fractions (the first
  group sets it);
* prompts never returned yet sit in the ``new`` pool; the others fall into pools cut at ``thresholds`` (hardest
  first), and each draw picks a pool by its weight among the non-empty ones, then a prompt in it at random;
* a prompt whose rate reaches ``retire_at`` (after ``min_groups`` groups) is *retired*: solved, never drawn again;
* a prompt whose rate is 0 (nothing solved) is *parked* for ``requeue_delay`` draws, then eligible again;
* a prompt drawn in the last ``lag`` draws is not drawn again while another can be (its group may be in flight);
* a pool of weight 0 is drawn only when no weighted pool has an eligible prompt (so the run never stalls on it).

Determinism. Draws are numbered (the flat index the trainer settles, ``pool_source.py``), and draw ``f`` is a pure
function of the seed, ``f`` and the results of draws ``0 .. f - lag - 1`` *learnt in draw order*: the pools learn
a group's result only after ``lag`` more draws, whatever order the groups came back in, and draw ``f``
waits (``ready``) until every result it must learn is back. Its randomness is ``Random(f"{seed}/{f}")``, so there
is no generator state to carry. Hence timing (which group returns first, how far the worker runs ahead) never
changes which prompts are drawn; what can change them is the results themselves: a reward that depends on the
sampled completions varies with the weights that generated them, which in an asynchronous run depend on timing.
With results that repeat (a seeded run whose groups score the same), the draws repeat exactly, and a killed and
resumed run draws what the uninterrupted one drew. The cost: at most ``lag + 1`` groups are in flight.

The trainer keeps a copy (``trainer/data_accounting.py``) that learns each settled group's result under its draw
index and applies them in the same order (``settle``); a checkpoint saves it (``state_dict``: plain JSON), and the
resumed worker starts from it: the applied prefix, plus the results (and rows) of the draws past it that were
settled, which the resumed worker does not generate again.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NEW_POOL = "new"
UNKNOWN_ROW = -1  # a settled draw's row when the checkpoint has no pools state (taught nothing)
POOL_METRICS: dict[str, str] = {
    "pools/{pool}/size": "prompts in the pool (new, hard, medium, easy with the default cuts) at the step's end",
    "pools/{pool}/pass_rate": "mean running pass rate of the pool's prompts (NaN while none has returned)",
    "pools/retired": "prompts retired as solved so far",
    "pools/parked": "unsolved prompts waiting out prompt_pool_requeue_delay",
    "pools/draw_wait_s": "per wait, seconds a draw waited for a result it must learn first (often: raise "
    "prompt_pool_lag)",
}


@dataclass(frozen=True)
class PoolSettings:
    """How prompts are pooled; the config's ``prompt_pool_*`` fields (``config_data.py``).

    Args:
        thresholds: ascending pass-rate cuts in (0, 1); ``len(thresholds) + 1`` pools, hardest first.
        weights: one sampling weight per pool of ``names`` (``new`` first), >= 0.
        retire_at: a prompt whose running pass rate reaches this is retired (> 1: never).
        min_groups: groups a prompt needs before it can be retired.
        requeue_delay: draws an unsolved prompt (rate 0) waits, once learnt, before it can be drawn again.
        ema: weight of the newest group in the running pass rate (1.0: the last group alone).
        seed: the draws' random seed.
        lag: draws between a draw and the one that first sees its result; at most ``lag + 1`` groups are in
            flight (the price of draws that do not depend on timing).
    """

    thresholds: tuple[float, ...] = (0.2, 0.8)
    weights: tuple[float, ...] = (1.0, 1.0, 2.0, 1.0)
    retire_at: float = 1.0
    min_groups: int = 2
    requeue_delay: int = 64
    ema: float = 0.5
    seed: int = 0
    lag: int = 32

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
        if self.lag < 0:
            out.append(f"prompt_pool_lag={self.lag}: give the draws a result waits (>= 0)")
        if self.min_groups < 1 or self.requeue_delay < 0:
            out.append(
                f"prompt_pool_min_groups={self.min_groups}, prompt_pool_requeue_delay={self.requeue_delay}: "
                "need min_groups >= 1 and requeue_delay >= 0"
            )
        return out


class PromptPools:
    """Draws prompt indices of a dataset of ``num_prompts`` rows by difficulty (see the module docstring).

    ``draw(f)`` picks draw ``f``'s row; ``learn(f, row, fraction)`` stores draw ``f``'s result, applied in draw
    order once draw ``f + lag + 1`` is made (the worker) or once every draw up to ``f + lag`` has a result (the
    trainer's copy, ``settle``).
    """

    def __init__(self, num_prompts: int, settings: PoolSettings) -> None:
        problems = settings.problems()
        if problems:
            raise ValueError("; ".join(problems))
        if num_prompts < 1:
            raise ValueError("prompt pools need a dataset with at least one prompt (and a length)")
        self.n = num_prompts
        self.s = settings
        self.rate: dict[int, float] = {}  # prompt -> running pass rate (returned prompts only)
        self.groups: dict[int, int] = {}  # prompt -> groups learnt
        self.parked: dict[int, int] = {}  # prompt -> draw index from which it is eligible again
        self.retired: set[int] = set()
        self.applied = 0  # draws 0 .. applied-1 are learnt, in draw order
        self.results: dict[int, tuple[int, float | None]] = {}  # draw >= applied -> (row, pass fraction) known
        self.rows: dict[int, int] = {}  # draw >= applied -> its row

    # ---- drawing -------------------------------------------------------------------------------------------------
    def pool_of(self, prompt: int) -> str:
        if prompt not in self.rate:
            return NEW_POOL
        i = sum(self.rate[prompt] >= t for t in self.s.thresholds)
        return self.s.names[1 + i]

    @property
    def clock(self) -> int:
        """The draw the learnt state is current for (draw ``f`` learns draws before ``f - lag``); parked prompts
        are counted against it in ``metrics``."""
        return self.applied + self.s.lag

    def ready(self, draw: int) -> bool:
        """Whether draw ``draw`` can be made: every result it must learn first (draws before ``draw - lag``) is in."""
        return all(g in self.results for g in range(self.applied, draw - self.s.lag))

    def draw(self, draw: int) -> int | None:
        """Draw number ``draw``'s row (None once every prompt is retired). A draw whose row is known (settled before
        a resume) gives that row again. Call only when ``ready(draw)``, with draws in increasing order."""
        if not self.ready(draw):
            raise RuntimeError(f"draw {draw} made before the results of draws {self.applied}..{draw - self.s.lag - 1}")
        self._apply_until(draw - self.s.lag)
        if draw in self.rows:
            return self.rows[draw]
        recent = {self.rows[g] for g in range(max(draw - self.s.lag, 0), draw) if g in self.rows}
        rng = random.Random(f"{self.s.seed}/{draw}")  # keyed by the draw: nothing to carry across a resume
        row = self._choose(rng, draw, recent)
        if row is not None:
            self.rows[draw] = row
        return row

    def _choose(self, rng: random.Random, now: int, recent: set[int]) -> int | None:
        """A pool by weight, then a prompt in it; relaxed step by step when nothing is eligible: prompts drawn
        recently may be drawn again, then parked ones (a draw never waits for a delay to run out)."""
        live = [p for p in range(self.n) if p not in self.retired]
        for rule in (lambda p: p not in recent and self.parked.get(p, 0) <= now,
                     lambda p: self.parked.get(p, 0) <= now, lambda p: True):  # fmt: skip
            pools: dict[str, list[int]] = {name: [] for name in self.s.names}
            for p in filter(rule, live):
                pools[self.pool_of(p)].append(p)
            names = [name for name in self.s.names if pools[name]]
            if names:
                weights = [self.s.weights[self.s.names.index(name)] for name in names]
                if not any(w > 0 for w in weights):  # only weight-0 pools hold eligible prompts: drawn evenly
                    weights = [1.0] * len(names)
                pool = pools[rng.choices(names, weights=weights)[0]]
                return pool[rng.randrange(len(pool))]
        return None  # every prompt retired

    @property
    def exhausted(self) -> bool:
        """Every prompt is retired: the source has no more data."""
        return len(self.retired) == self.n

    # ---- learning from returned groups ---------------------------------------------------------------------------
    def learn(self, draw: int, row: int, pass_fraction: float | None) -> None:
        """Draw ``draw`` (of dataset row ``row``) returned with this fraction of passing samples (None: not scored,
        e.g. rejected). Kept until its turn in draw order; a second result for the same draw (a group generated
        again after a resume) is ignored."""
        if not 0 <= row < self.n:
            raise ValueError(f"prompt {row} is not a row of the dataset's {self.n} prompts")
        if pass_fraction is not None and not 0.0 <= pass_fraction <= 1.0:
            raise ValueError(f"pass_fraction must be in [0, 1], got {pass_fraction}")
        if draw < self.applied:
            return
        if self.rows.setdefault(draw, row) != row:
            raise ValueError(f"draw {draw} was of row {self.rows[draw]}, not {row}")
        self.results.setdefault(draw, (row, pass_fraction))

    def settle(self) -> None:
        """The trainer's copy: apply what a worker about to make the first draw without a result has applied."""
        first_unknown = self.applied
        while first_unknown in self.results:
            first_unknown += 1
        self._apply_until(first_unknown - self.s.lag)

    def _apply_until(self, end: int) -> None:
        while self.applied < end:
            row, fraction = self.results.pop(self.applied)
            self.rows.pop(self.applied, None)
            if row != UNKNOWN_ROW:
                self.record(row, fraction, self.applied)
            self.applied += 1

    def record(self, prompt: int, pass_fraction: float | None, draw: int) -> str:
        """Apply one group of ``prompt`` drawn as number ``draw``; returns what became of the prompt: ``retired``,
        ``parked`` (until draw ``draw + lag + 1 + requeue_delay``: the delay runs from when it is learnt) or its
        pool's name."""
        if pass_fraction is None:
            return self.pool_of(prompt)
        old = self.rate.get(prompt)
        self.rate[prompt] = pass_fraction if old is None else (1 - self.s.ema) * old + self.s.ema * pass_fraction
        self.groups[prompt] = self.groups.get(prompt, 0) + 1
        self.parked.pop(prompt, None)
        if self.rate[prompt] >= self.s.retire_at and self.groups[prompt] >= self.s.min_groups:
            self.retired.add(prompt)
            return "retired"
        if self.rate[prompt] == 0.0 and self.s.requeue_delay > 0:
            self.parked[prompt] = draw + self.s.lag + 1 + self.s.requeue_delay
            return "parked"
        return self.pool_of(prompt)

    # ---- metrics and checkpoints ---------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """``pools/<pool>/size`` and ``pools/<pool>/pass_rate`` (mean running rate; NaN when empty), retired and
        parked counts, in the order of ``names``, as learnt so far."""
        out: dict[str, float] = {}
        for name in self.s.names:
            members = [p for p in range(self.n) if p not in self.retired and self.pool_of(p) == name]
            rates = [self.rate[p] for p in members if p in self.rate]
            out[f"pools/{name}/size"] = float(len(members))
            out[f"pools/{name}/pass_rate"] = sum(rates) / len(rates) if rates else float("nan")
        out["pools/retired"] = float(len(self.retired))
        out["pools/parked"] = float(sum(1 for at in self.parked.values() if at > self.clock))
        return out

    def state_dict(self) -> dict:
        """Plain JSON: everything later draws depend on. Draws past ``applied`` without a result (in flight) are
        not state: they are drawn again after a resume, the same way."""
        return {
            "num_prompts": self.n,
            "lag": self.s.lag,
            "seed": self.s.seed,
            "applied": self.applied,
            "rate": {str(p): r for p, r in sorted(self.rate.items())},
            "groups": {str(p): g for p, g in sorted(self.groups.items())},
            "parked": {str(p): at for p, at in sorted(self.parked.items())},
            "retired": sorted(self.retired),
            "results": {str(d): [row, f] for d, (row, f) in sorted(self.results.items())},
        }

    def load_state_dict(self, state: dict) -> None:
        if int(state["num_prompts"]) != self.n:
            raise ValueError(
                f"the pools' state was saved for {state['num_prompts']} prompts but the dataset has {self.n}: "
                "resume with the same dataset"
            )
        if "lag" not in state:
            raise ValueError("the pools' state was saved by an older asyncgrpo (no draw order): start a new run")
        if int(state["lag"]) != self.s.lag:
            raise ValueError(f"the pools' state was saved with prompt_pool_lag={state['lag']}: resume with it")
        self.applied = int(state["applied"])
        self.rate = {int(p): float(r) for p, r in state["rate"].items()}
        self.groups = {int(p): int(g) for p, g in state["groups"].items()}
        self.parked = {int(p): int(at) for p, at in state["parked"].items()}
        self.retired = {int(p) for p in state["retired"]}
        self.results = {int(d): (int(row), None if f is None else float(f)) for d, (row, f) in state["results"].items()}
        self.rows = {d: row for d, (row, _) in self.results.items() if row != UNKNOWN_ROW}


def pass_fraction(rewards: Sequence[float], threshold: float) -> float | None:
    """Fraction of a group's rewards at or above ``threshold`` (NaN: unscored, left out); None if none scored."""
    scored = [r for r in rewards if not math.isnan(r)]
    return sum(r >= threshold for r in scored) / len(scored) if scored else None


def resumed_pools(
    num_prompts: int, settings: PoolSettings, state: dict | None, start_index: int = 0, skip: Iterable[int] = ()
) -> PromptPools:
    """The pools of a run starting at draw ``start_index`` with the draws ``skip`` settled past it: the checkpoint's
    state (the trainer's copy), or fresh pools when it has none (a checkpoint of a run without pools: the draws
    it settled, whose rows are unknown, count as draws that taught nothing). Both processes build theirs here."""
    pools = PromptPools(num_prompts, settings)
    if state is not None:
        pools.load_state_dict(state)
    else:
        pools.applied = start_index
    for draw in skip:
        if draw >= pools.applied and draw not in pools.results:
            pools.results[draw] = (UNKNOWN_ROW, None)
    return pools

"""Token-budget planner: which samples share a row, and when a micro-batch closes (SPEC P2-P4).

A micro-batch holds one row per process; ``gradient_accumulation_steps`` micro-batches
make an optimizer step. Samples arrive in queue order (a group's samples together) and
are placed one at a time:

1. a sample goes to the row already holding its group, if it fits there;
2. a sample of a new group goes to the row where it fits and leaves the lowest load;
3. a sample whose group row is full goes to an empty row, or to a row where it fits
   without raising the micro-batch's highest load (that row sets the micro-batch's time);
4. otherwise the micro-batch closes and the sample opens the next one.

"Fits" means the row's forwarded tokens (shared prefixes counted once) stay within
``token_budget``; the load of a row is its attention cost (sum over tokens of the keys
each attends to). A sample longer than the budget can never fit and is dropped with a
warning.

With ``keep_groups=True`` (the trainer's setting) the samples of a group are held until
the group ends (``end_group``, a sample of another group, or ``flush``) and placed together:
in the row where the whole group fits with the lowest resulting load, else in a new
micro-batch, so its prompt is forwarded once. Only a group larger than the budget is
placed sample by sample with the rules above (and then spans rows), and so is a group
the caller's ``must_not_wait`` flags (the trainer: a group that would be too stale in a
later step) when it does not fit whole: it fills the open micro-batch and only the rest
waits, as without ``keep_groups``.

A step need not wait for the group that would close its last micro-batch: ``pull`` may answer
``GROUP_END`` after a group's last sample, so the group is placed at once instead of when the
next group's first sample arrives, and ``CLOSE`` when it holds no sample and
``cannot_take_a_group`` (no row has room for the smallest of the last groups placed). Without
both, a step of two groups waited for two more: on one GPU at the 135M shape every second or
third step waited 60-130 ms for groups it would not train.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from asyncgrpo.packing.row import PackedRow, pack_trie
from asyncgrpo.packing.sample import PackSample
from asyncgrpo.packing.trie import PrefixTrie

logger = logging.getLogger(__name__)

RECENT_GROUPS = 16  # cannot_take_a_group compares a row's room with the smallest of this many last groups


class PullMark(enum.Enum):
    """What ``plan_step``'s ``pull`` may answer instead of a sample."""

    GROUP_END = "the samples pulled since the last group end complete their group: place it now"
    CLOSE = "the open micro-batch can take none of the last groups: close it now"


GROUP_END = PullMark.GROUP_END
CLOSE = PullMark.CLOSE


@dataclass
class MicroBatch:
    """One row (a :class:`PrefixTrie`) per process; row i is forwarded by process i."""

    rows: list[PrefixTrie] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(len(r) for r in self.rows)

    def pack(self) -> list[PackedRow]:
        """Lay every row out for the forward (an empty row packs to zero tokens)."""
        return [pack_trie(r) for r in self.rows]


class TokenBudgetBatcher:
    """Places samples into rows of at most ``token_budget`` forwarded tokens.

    Args:
        token_budget: forwarded-token limit of a row (shared tokens counted once).
        num_processes: rows per micro-batch.
        share_prefixes: False gives plain padding-free packing (every sample its own chain).
        keep_groups: place a group's samples together once the group ends (see the module docstring).
        must_not_wait: with ``keep_groups``, a group (its samples) for which this is true is never moved whole to
            a new micro-batch: it is placed sample by sample when it does not fit whole (see the module docstring).

    Raises:
        ValueError: when ``token_budget`` or ``num_processes`` is not positive.
    """

    def __init__(
        self,
        token_budget: int,
        num_processes: int = 1,
        share_prefixes: bool = True,
        keep_groups: bool = False,
        must_not_wait: Callable[[Sequence[PackSample]], bool] | None = None,
    ) -> None:
        if token_budget <= 0:
            raise ValueError(f"token_budget must be a positive number of tokens, got {token_budget}")
        if num_processes <= 0:
            raise ValueError(f"num_processes must be >= 1, got {num_processes}")
        self.token_budget = token_budget
        self.num_processes = num_processes
        self.share_prefixes = share_prefixes
        self.keep_groups = keep_groups
        self.must_not_wait = must_not_wait
        self._group: list[PackSample] = []  # keep_groups: the incoming group, not placed yet
        self._closed: deque[MicroBatch] = deque()  # closed by a group placement, not yet returned
        self.dropped_oversize_count = 0  # since the last take_dropped_count()
        self._open = self._new_micro_batch()
        self._placed: list[PackSample] = []  # samples of the open micro-batch, in placement order
        self._recent_groups: deque[int] = deque(maxlen=RECENT_GROUPS)  # tokens the last groups needed (see below)

    def _new_micro_batch(self) -> MicroBatch:
        return MicroBatch([PrefixTrie(self.share_prefixes) for _ in range(self.num_processes)])

    @property
    def pending_samples(self) -> int:
        """Samples held by the planner: the open micro-batch, closed ones not yet returned, the incoming group."""
        return self._open.num_samples + len(self._group) + sum(mb.num_samples for mb in self._closed)

    def take_dropped_count(self) -> int:
        """Oversize samples dropped since the last call (``batch/dropped_oversize_count``)."""
        n, self.dropped_oversize_count = self.dropped_oversize_count, 0
        return n

    def add(self, sample: PackSample) -> MicroBatch | None:
        """Place ``sample``; returns the micro-batch it closed, if any (the sample opens the next one)."""
        if len(sample) > self.token_budget:
            self.dropped_oversize_count += 1
            logger.warning(
                "dropping a sample of %d tokens: longer than token_budget=%d (raise token_budget to keep such samples)",
                len(sample),
                self.token_budget,
            )
            return None
        if not self.keep_groups:
            return self._place(sample)
        if self._group and sample.group_id != self._group[-1].group_id:
            self._place_group(self._group)
            self._group = []
        self._group.append(sample)
        return self.pop_closed()

    def end_group(self) -> MicroBatch | None:
        """The held group is complete (its last sample was added): place it now rather than when the next group's
        first sample arrives; returns the micro-batch the placement closed, if any."""
        if self.keep_groups and self._group:
            self._place_group(self._group)
            self._group = []
        return self.pop_closed()

    def pop_closed(self) -> MicroBatch | None:
        """A micro-batch closed by an earlier placement and not returned yet (a group larger than the budget may
        close several), or None."""
        return self._closed.popleft() if self._closed else None

    def cannot_take_a_group(self) -> bool:
        """Whether the open micro-batch is as full as the last groups allow: it holds samples, nothing waits to be
        placed, and no row has room for the smallest of the last ``RECENT_GROUPS`` groups (their forwarded tokens;
        for a group larger than a row, which is placed sample by sample, its shortest sample).
        Then a step closes it rather than wait for a group that would most likely not fit (a smaller group that
        comes later opens the next micro-batch)."""
        if not self.keep_groups or self._group or self._closed or not self._recent_groups:
            return False
        if self._open.num_samples == 0:
            return False
        smallest = min(self._recent_groups)
        return all(self.token_budget - row.num_tokens < smallest for row in self._open.rows)

    def _place(self, sample: PackSample) -> MicroBatch | None:
        """Rules 1-4 for one sample; returns the micro-batch it closed, if any."""
        row = self._choose_row(self._open.rows, sample)
        if row is not None:
            row.insert(sample)
            self._placed.append(sample)
            return None
        closed, self._open = self._open, self._new_micro_batch()
        self._open.rows[0].insert(sample)
        self._placed = [sample]
        return closed

    def _place_group(self, samples: list[PackSample]) -> None:
        """Place a whole group in one row when it fits in one (closing the micro-batch if needed)."""
        alone = PrefixTrie(self.share_prefixes)
        for s in samples:
            alone.insert(s)
        # what the next group would need: the whole group, or one sample where it is placed sample by sample
        whole = len(samples) > 1 and alone.num_tokens <= self.token_budget
        self._recent_groups.append(alone.num_tokens if whole else min(len(s) for s in samples))
        if len(samples) == 1 or alone.num_tokens > self.token_budget:
            for s in samples:
                closed = self._place(s)
                if closed is not None:
                    self._closed.append(closed)
            return
        rows = self._open.rows
        # sharing with what a row holds can only lower the group's cost there: the test is conservative
        fits = [i for i, r in enumerate(rows) if r.num_tokens + alone.num_tokens <= self.token_budget]
        if fits:
            row = rows[min(fits, key=lambda i: rows[i].attention_cost)]
        elif self.must_not_wait is not None and self.must_not_wait(samples):
            for s in samples:  # what fits goes now; the rest opens the next micro-batch
                closed = self._place(s)
                if closed is not None:
                    self._closed.append(closed)
            return
        else:
            self._closed.append(self._open)
            self._open, self._placed = self._new_micro_batch(), []
            row = self._open.rows[0]
        for s in samples:
            row.insert(s)
            self._placed.append(s)

    def held_samples(self) -> list[PackSample]:
        """The samples the planner holds (not yet returned in a micro-batch), without removing them."""
        rows = [row for mb in self._closed for row in mb.rows] + self._open.rows
        return [s for row in rows for s in row.samples] + list(self._group)

    def take_open_samples(self) -> list[PackSample]:
        """Empty the planner (open micro-batch, closed ones not yet returned, the incoming group) and return its
        samples in placement order (to re-check or re-place them)."""
        samples = [s for mb in self._closed for row in mb.rows for s in row.samples]
        open_samples = [s for row in self._open.rows for s in row.samples]
        order = {id(s): i for i, s in enumerate(self._placed)}
        open_samples.sort(key=lambda s: order.get(id(s), 0))
        samples += open_samples + self._group
        self._open = self._new_micro_batch()
        self._placed, self._group = [], []
        self._closed.clear()
        return samples

    def flush(self) -> MicroBatch | None:
        """Close and return a micro-batch (a held group is placed first), or None when the planner is empty.

        After a group placement one call may leave another closed micro-batch behind: call until None.
        """
        if self._group:
            self._place_group(self._group)
            self._group = []
        if self._closed:
            return self._closed.popleft()
        if self._open.num_samples == 0:
            return None
        closed, self._open = self._open, self._new_micro_batch()
        self._placed = []
        return closed

    def _choose_row(self, rows: list[PrefixTrie], sample: PackSample) -> PrefixTrie | None:
        costs = [r.cost_of(sample) for r in rows]
        fits = [r.num_tokens + tokens <= self.token_budget for r, (tokens, _) in zip(rows, costs)]
        new_load = [r.attention_cost + cost for r, (_, cost) in zip(rows, costs)]
        holds_group = [sample.group_id in r.group_ids for r in rows]
        # 1. the row holding the group (the one sharing most, if the group spans several)
        group_rows = [i for i in range(len(rows)) if holds_group[i] and fits[i]]
        if group_rows:
            return rows[min(group_rows, key=lambda i: costs[i][0])]
        if not any(holds_group):  # 2. a new group: where it fits with the lowest resulting load
            open_rows = [i for i in range(len(rows)) if fits[i]]
            return rows[min(open_rows, key=lambda i: new_load[i])] if open_rows else None
        # 3. the group's row is full: an empty row, or one whose load stays within the current maximum
        empty = [i for i in range(len(rows)) if len(rows[i]) == 0]
        if empty:
            return rows[empty[0]]
        peak = max(r.attention_cost for r in rows)
        spare = [i for i in range(len(rows)) if fits[i] and new_load[i] <= peak]
        return rows[min(spare, key=lambda i: new_load[i])] if spare else None


def plan_step(
    batcher: TokenBudgetBatcher, pull: Callable[[], PackSample | PullMark | None], gradient_accumulation_steps: int
) -> list[MicroBatch]:
    """Pull samples until ``gradient_accumulation_steps`` micro-batches are closed.

    ``pull`` returns the next sample, a ``PullMark`` (``GROUP_END``: place the group just pulled; ``CLOSE``: close
    the open micro-batch now), or None when no more will come (the open micro-batch is then flushed and the step
    may be short). A sample that closes the last micro-batch stays in the batcher and opens the next step.
    """
    out: list[MicroBatch] = []
    while len(out) < gradient_accumulation_steps:
        item = pull()
        if item is None:
            while len(out) < gradient_accumulation_steps and (closed := batcher.flush()) is not None:
                out.append(closed)
            break
        if item is GROUP_END:
            closed = batcher.end_group()
        elif item is CLOSE:
            closed = batcher.flush()
        else:
            closed = batcher.add(item)
        while closed is not None:
            out.append(closed)
            closed = batcher.pop_closed() if len(out) < gradient_accumulation_steps else None
    return out


def batch_metrics(
    micro_batches: Sequence[Sequence[PackedRow]], token_budget: int, dropped_oversize: int = 0
) -> dict[str, float]:
    """The ``batch/*`` metrics of one step (docs/metrics.md) (rows of every process).

    Step-wise metrics are sums over the step; row-wise metrics are means over its rows;
    ``row_imbalance`` is the mean over micro-batches of (most expensive row / mean row);
    ``pad_frac`` is the padding needed to send each micro-batch's rows as one rectangle.
    """
    rows = [r for mb in micro_batches for r in mb]
    if not rows:
        return {"batch/dropped_oversize_count": float(dropped_oversize)}
    fwd = sum(r.num_tokens for r in rows)
    imbalance, pad, area = [], 0, 0
    for mb in micro_batches:
        costs = [r.attention_cost for r in mb]
        mean = sum(costs) / len(costs)
        imbalance.append(max(costs) / mean if mean else 1.0)
        longest = max(r.num_tokens for r in mb)
        pad += sum(longest - r.num_tokens for r in mb)
        area += longest * len(mb)
    return {
        "batch/forwarded_tokens_per_step": float(fwd),
        "batch/trained_tokens_per_step": float(sum(r.num_trained for r in rows)),
        "batch/samples_per_step": float(sum(len(r.samples) for r in rows)),
        "batch/groups_per_step": float(len({s.group_id for r in rows for s in r.samples})),
        "batch/microbatches_per_step": float(len(micro_batches)),
        "batch/masked_token_frac": 1.0 - sum(r.num_trained_positions for r in rows) / max(1, fwd),
        "batch/samples_per_row": sum(len(r.samples) for r in rows) / len(rows),
        "batch/row_tokens_mean": fwd / len(rows),
        "batch/row_tokens_max": float(max(r.num_tokens for r in rows)),
        "batch/row_fill_frac": fwd / len(rows) / token_budget,
        "batch/row_imbalance": sum(imbalance) / len(imbalance),
        "batch/packing_ratio": sum(r.num_flat_tokens for r in rows) / max(1, fwd),
        "batch/pad_frac": pad / max(1, area),
        "batch/dropped_oversize_count": float(dropped_oversize),
    }

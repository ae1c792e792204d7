"""Groups held by the planner (``keep_groups``) in the trainer's prompt accounting: checkpoints, G3, G4, end of data.

The trainer side is real (``RolloutSource``, ``TokenBudgetBatcher``, the checkpoint's ``rollout_state.json`` and
``prepare_resume``); the worker's side is played by ``ScriptedWorker``: the groups a worker sends for the prompts
``PromptOrder`` gives it (a resume's start and skips included), one ``GroupResult`` per prompt, then the end marker.
The reference is the definition: every prompt of the epoch trained exactly once, all its samples, across any kill.
"""

from __future__ import annotations

from collections import Counter, deque

from asyncgrpo.packing import MicroBatch, TokenBudgetBatcher
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.prompt_order import PromptOrder
from asyncgrpo.trainer.checkpoint import prepare_resume, write_rollout_state
from asyncgrpo.trainer.rollout_source import RolloutSource
from asyncgrpo.types import TrainingSequence
from tests.helpers.scripted_workers import QuietWorker

G = 4  # samples per prompt


def _group(flat: int, group_id: int, version: int) -> GroupResult:
    """Prompt ``flat``: a prompt of 10-18 tokens of its own and G completions of 3-6 tokens (trie: ~30-45 tokens)."""
    prompt = [1000 + 37 * flat + j for j in range(10 + (flat * 7) % 9)]
    seqs = []
    for i in range(G):
        completion = [50_000 + 100 * flat + 10 * i + j for j in range(3 + (flat + i) % 4)]
        ids = prompt + completion
        mask = [0] * len(prompt) + [1] * len(completion)
        seqs.append(TrainingSequence(ids, mask, [-0.5 if m else 0.0 for m in mask], float(i) - 1.5, version,
                                     group_id, flat))  # fmt: skip
    return GroupResult(flat, flat // 1_000_000, group_id, version, seqs, tokens=sum(len(s.input_ids) for s in seqs))


class _Channels:
    def __init__(self) -> None:
        self.queued = 0

    def count_queued(self, n: int) -> None:
        self.queued += n


class ScriptedWorker(QuietWorker):
    """What the trainer sees of a rollout worker: groups in ``PromptOrder``, stamped with ``version``, then the end.

    ``consumed`` is the G3 counter the trainer reports into (``report_consumed``), as the real worker's shared value.
    """

    def __init__(self, num_prompts: int, start: int = 0, skip: frozenset[int] = frozenset()) -> None:
        order = PromptOrder(list(range(num_prompts)), start, num_epochs=1, skip=skip)
        self.prompts = deque(flat for e in order.epochs() for _, flat, _ in order.epoch_rows(e))
        self.version = 0
        self.consumed = 0
        self.channels = _Channels()
        self._group_id = 0
        self._ended = False
        self.consumed_at_get: list[int] = []  # ``consumed`` each time the trainer asked for a sample

    def get_sample(self, timeout: float) -> GroupResult:
        self.consumed_at_get.append(self.consumed)
        if self.prompts:
            self._group_id += 1
            return _group(self.prompts.popleft(), self._group_id, self.version)
        if self._ended:
            raise TimeoutError(f"no sample within {timeout}s: the script ended")
        self._ended = True
        return GroupResult.end_of_data()

    def report_consumed(self, tokens: int) -> None:
        self.consumed += tokens

    def queue_size(self) -> int:
        return len(self.prompts) * G


def _source(worker: ScriptedWorker, n: int, budget: int = 80, max_staleness: int = 100, **resume) -> RolloutSource:
    batcher = TokenBudgetBatcher(budget, 1, keep_groups=True)
    return RolloutSource(worker, batcher, 1, max_staleness, n, total_prompts=n, **resume)


def _trained(micro: list[MicroBatch]) -> Counter:
    return Counter(s.meta.row_index for mb in micro for row in mb.rows for s in row.samples)


def _run(source: RolloutSource, first_step: int, steps: int | None = None) -> list[Counter]:
    """Steps as the trainer runs them (``get_batch_samples`` then ``on_step_end``); one Counter per step."""
    out: list[Counter] = []
    while not source.finished and (steps is None or len(out) < steps):
        micro = source.next_step(first_step + len(out))
        if not micro:
            break
        source.step_done(micro)
        out.append(_trained(micro))
    return out


def test_a_kill_after_any_step_loses_and_duplicates_no_prompt(tmp_path):
    n = 14
    uninterrupted = _run(_source(ScriptedWorker(n), n), 0)
    assert sum(uninterrupted, Counter()) == Counter({p: G for p in range(n)})
    held_at_a_checkpoint = 0
    for k in range(1, len(uninterrupted)):
        out = tmp_path / f"kill-after-{k}"
        source = _source(ScriptedWorker(n), n)
        before = _run(source, 0, steps=k)
        # The checkpoint of step k, written as the trainer's on_save does; then the process dies (planner lost).
        held = {s.meta.row_index for s in source.batcher.held_samples()}
        first, settled = source.checkpoint_state()
        assert not held & ({p for p in range(first)} | set(settled)), "a held prompt was recorded as settled"
        held_at_a_checkpoint += bool(held)
        ckpt = out / f"checkpoint-{k}"
        ckpt.mkdir(parents=True)
        write_rollout_state(ckpt, first, n, settled, step=k)
        point = prepare_resume(str(ckpt), n, str(out))
        resumed = _source(ScriptedWorker(n, point.start_index, point.skip), n, start_index=point.start_index,
                          settled=point.settled)  # fmt: skip
        after = _run(resumed, k)
        assert sum(before + after, Counter()) == Counter({p: G for p in range(n)}), f"killed after step {k}"
    assert held_at_a_checkpoint >= 3, "the scenario must hold a group in the planner at checkpoints"


def test_held_samples_count_as_queued_for_the_worker_allowance_until_the_next_step_pulls():
    n = 10
    worker = ScriptedWorker(n)
    source = _source(worker, n)
    trained_tokens = 0
    for step in range(4):
        pulled_so_far = trained_tokens + sum(len(s.token_ids) for s in source.carried_samples())
        worker.consumed_at_get.clear()
        micro = source.next_step(step)
        # Pulling: everything pulled so far is released (a step never waits for the worker on tokens it holds).
        assert worker.consumed_at_get and worker.consumed_at_get[0] == pulled_so_far
        trained_tokens += sum(len(s.token_ids) for mb in micro for row in mb.rows for s in row.samples)
        assert source.batcher.held_samples(), "each step of this scenario leaves a group in the planner"
        # Training: the held group counts as still queued (G3), so the worker is not ahead by it.
        assert worker.consumed == trained_tokens
        source.step_done(micro)


def test_a_group_at_its_last_fresh_step_is_not_postponed_whole():
    # max_staleness = 1, every group stamped 0: step 2 (policy version 1) is every group's last fresh step. Groups
    # 0+1 fill step 1, 2+3 step 2; group 4 does not fit whole next to them (their row has room for one sample).
    def trained_per_step(rule: bool) -> list[Counter]:
        source = _source(ScriptedWorker(6), 6, budget=88, max_staleness=1)
        if not rule:
            source.batcher.must_not_wait = lambda samples: False
        return _run(source, 0)

    with_rule = trained_per_step(True)
    assert with_rule[:2] == [Counter({0: G, 1: G}), Counter({2: G, 3: G, 4: 1})]
    # its other samples are 2 behind by step 3 and dropped, but its prompt was trained; without the rule the whole
    # group waits for step 3 and is dropped there: the prompt is lost (group 5 arrives too late either way)
    assert sum(trained_per_step(False), Counter()) == Counter({p: G for p in range(4)})
    assert set(sum(with_rule, Counter())) == {0, 1, 2, 3, 4}


def test_a_group_held_at_the_end_of_the_data_is_trained():
    n = 5
    source = _source(ScriptedWorker(n), n)
    steps = _run(source, 0)
    assert sum(steps, Counter()) == Counter({p: G for p in range(n)})
    assert steps[-1][n - 1] == G  # the last group was held until the end marker, then placed and trained
    assert source.finished and source.batcher.pending_samples == 0 and source.prompts_consumed == n

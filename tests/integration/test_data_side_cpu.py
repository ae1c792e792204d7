"""Dynamic sampling and prompt pools end to end on CPU: real server, worker and trainer on the tiny model (issue 36).

A scripted reward makes every even dataset row a tied group (all 1.0: dropped, no signal) and scores odd rows by
their tokens, so about one generated group in two is kept; the tests check what the per-step metrics say against
the groups the reward function itself recorded, and which prompts each step trained (``RolloutSource.step_done``
is watched, not replaced). Dynamic sampling on (the default) fills steps with kept groups; off, a tied group keeps
its room in its step, so steps train about half as many samples and pull only the groups their budget holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.tasks.eval_sets import EvalSet
from asyncgrpo.tasks.reasoning import reasoning_gym_dataset
from asyncgrpo.trainer.rollout_source import RolloutSource
from tests.helpers.pool_states import check_pools_state
from tests.helpers.rewards import even_token_reward, half_constant_reward

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir, "--max-model-len", "256", "--kv-cache-tokens", "16384")


def _dataset(size: int):
    ds = reasoning_gym_dataset("chain_sum", size=size, seed=0, system_prompt=None)
    return ds.add_column("idx", list(range(size)))


def _config(tmp_path: Path, server, **overrides) -> AsyncGRPOConfig:
    base = dict(  # noqa: C408 - AsyncGRPOConfig keyword arguments
        output_dir=str(tmp_path / "out"), max_steps=3, num_generations=4, max_completion_length=12,
        token_budget=384, vllm_server_base_url=server.base_url, report_to=[], save_strategy="no",
        learning_rate=1e-3, gradient_checkpointing=False, vllm_server_timeout=120, rollout_worker_timeout=60, seed=0,
    )  # fmt: skip
    base.update(overrides)
    return AsyncGRPOConfig(**base)


def _rows(tmp_path: Path) -> list[dict]:
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train_runtime" not in r]


def _watch_trained(monkeypatch) -> list[set[int]]:
    """The prompts (flat indices; one epoch, so the dataset's ``idx``) each step trains, as the trainer reports them."""
    steps: list[set[int]] = []
    original = RolloutSource.step_done

    def step_done(self, micro_batches):
        steps.append({s.meta.row_index for mb in micro_batches for row in mb.rows for s in row.samples})
        return original(self, micro_batches)

    monkeypatch.setattr(RolloutSource, "step_done", step_done)
    return steps


def test_dynamic_sampling_fills_steps_and_counts_generated_per_kept(tmp_path, server, tiny_llama_dir, monkeypatch):
    record = tmp_path / "groups.jsonl"
    monkeypatch.setenv("ASYNCGRPO_TEST_RECORD", str(record))
    trained_rows = _watch_trained(monkeypatch)
    args = _config(tmp_path, server, dynamic_sampling=True, dynamic_sampling_max_factor=8.0, eval_strategy="steps",
                   eval_steps=3)  # fmt: skip
    held_out = {
        "odd": EvalSet(_dataset(6).select([1, 3, 5]), num_samples=4, temperature=1.0),
        "even": EvalSet(_dataset(4).select([0, 2]), reward_funcs=[half_constant_reward, even_token_reward]),
    }
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[half_constant_reward], args=args,
                               train_dataset=_dataset(48), eval_dataset=held_out)  # fmt: skip
    assert trainer.train().global_step == 3
    # The two named sets, each with its own samples and rewards, scored at step 3.
    (evals,) = [r for r in _rows(tmp_path) if "eval/odd/reward" in r]
    assert evals["step"] == 3 and evals["eval/odd/num_prompts"] == 3 and evals["eval/even/num_prompts"] == 2
    assert {"eval/odd/pass@1", "eval/odd/pass@2", "eval/odd/pass@4", "eval/odd/mean@4"} <= set(evals)
    assert "eval/odd/pass@8" not in evals and "eval/odd/maj@1" not in evals  # 4 samples; no answer reader
    assert evals["eval/odd/pass@1"] == 0.0  # odd rows score below 1.0 unless all 12 tokens are even
    assert evals["eval/even/pass@1"] == 1.0  # even rows: half_constant_reward 1.0 plus even_token_reward >= 0
    assert evals["eval/even/rewards/even_token_reward/mean"] == pytest.approx(evals["eval/even/reward"] - 1.0)
    rows = [r for r in _rows(tmp_path) if "dynamic_sampling/generated_groups" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        generated, kept = r["dynamic_sampling/generated_groups"], r["dynamic_sampling/kept_groups"]
        assert kept >= 1  # every step trained groups with a signal
        assert r["dynamic_sampling/generated_per_kept"] == pytest.approx(generated / kept)
        assert r["dynamic_sampling/cap_hit"] == 0.0  # about 2 per kept group, far under 8
        assert r["batch/groups_per_step"] >= 1
    # The reward's own records: every even row tied (dropped), odd rows scored by tokens.
    groups = [json.loads(line) for line in record.read_text().splitlines()]
    assert all(len(set(g["rewards"])) == 1 for g in groups if g["row"] % 2 == 0)
    tied = sum(len(set(g["rewards"])) == 1 for g in groups)
    generated = sum(r["dynamic_sampling/generated_groups"] for r in rows)
    kept = sum(r["dynamic_sampling/kept_groups"] for r in rows)
    assert generated <= len(groups)  # the trainer pulled at most what the worker scored
    # Kept groups pulled are trained in their step or held for the next (a group stays in one row): no tied group
    # is trained, and what was pulled with a signal and not trained is at most the last step's carry-over.
    trained = sum(r["batch/groups_per_step"] for r in rows)
    assert 0 <= kept - trained <= 8, (kept, trained)
    # Groups are pulled in the order the worker finishes them, close to the dataset's: about half tie.
    assert 1.5 <= generated / kept <= 2.8, (generated, kept, tied, len(groups))
    # Every trained group had a signal (its recorded rewards differ), and every step is full: the group that did
    # not fit opened the next step, so a step holds more than the budget less one group.
    tied_rows = {g["row"] for g in groups if len(set(g["rewards"])) == 1}
    assert len(trained_rows) == 3 and all(trained_rows) and not set().union(*trained_rows) & tied_rows
    for r in rows:
        assert r["batch/forwarded_tokens_per_step"] > 384 - _largest_group(r), r


def _largest_group(r: dict) -> float:
    """A bound on one group's forwarded tokens in the step: its mean group (4 samples share a prompt) plus 4 full
    completions (12 tokens each) past the step's mean sample length."""
    return r["batch/forwarded_tokens_per_step"] / r["batch/groups_per_step"] + 4 * 12


def test_without_dynamic_sampling_tied_groups_keep_their_room(tmp_path, server, tiny_llama_dir, monkeypatch):
    record = tmp_path / "groups.jsonl"
    monkeypatch.setenv("ASYNCGRPO_TEST_RECORD", str(record))
    trained_rows = _watch_trained(monkeypatch)
    args = _config(tmp_path, server, dynamic_sampling=False, max_steps=4)
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[half_constant_reward], args=args,
                               train_dataset=_dataset(48))  # fmt: skip
    assert trainer.train().global_step == 4
    rows = [r for r in _rows(tmp_path) if "dynamic_sampling/generated_groups" in r]
    groups = [json.loads(line) for line in record.read_text().splitlines()]
    tied_rows = {g["row"] for g in groups if len(set(g["rewards"])) == 1}
    assert not set().union(*trained_rows) & tied_rows  # tied groups never train
    assert all(trained_rows) and [r["step"] for r in rows] == [1, 2, 3, 4]  # no step is empty
    generated = sum(r["dynamic_sampling/generated_groups"] for r in rows)
    kept = sum(r["dynamic_sampling/kept_groups"] for r in rows)
    assert 1.5 <= generated / kept <= 2.8, (generated, kept)  # the natural tie rate: about one group in two ties
    assert all(r["dynamic_sampling/cap_hit"] == 0.0 for r in rows)
    # A tied group keeps its room: steps train about half a budget (dynamic sampling fills each past 384 less one
    # group, over 254 tokens), and pull only the groups a budget holds, tied or not. With groups of the trained
    # groups' mean size, a step holds 384 / size groups, less the room lost when the next does not fit (< one group);
    # the last step's count also holds the group that closed it and at most one more pulled behind it.
    forwarded = [r["batch/forwarded_tokens_per_step"] for r in rows]
    assert sum(forwarded) / len(rows) < 0.7 * 384, forwarded
    size = sum(forwarded) / sum(r["batch/groups_per_step"] for r in rows)
    assert len(rows) * (384 / size - 1) <= generated <= len(rows) * 384 / size + 2, (generated, size)


def test_prompt_pools_retire_solved_rows_and_checkpoint_their_state(tmp_path, server, tiny_llama_dir, monkeypatch):
    """Even rows score 1.0 on every sample (solved: retired after one group); odd rows pass nowhere (their reward is
    below 1.0 unless all 12 tokens are even), so they are parked. The checkpoint holds the pools of what was settled,
    learnt in draw order two draws behind (``prompt_pool_lag=2``)."""
    record = tmp_path / "groups.jsonl"
    monkeypatch.setenv("ASYNCGRPO_TEST_RECORD", str(record))
    n = 16
    args = _config(tmp_path, server, prompt_pools=True, prompt_pool_min_groups=1, prompt_pool_requeue_delay=64,
                   prompt_pool_lag=2, save_strategy="steps", save_steps=3)  # fmt: skip
    trainer = AsyncGRPOTrainer(str(tiny_llama_dir), reward_funcs=[half_constant_reward], args=args,
                               train_dataset=_dataset(n))  # fmt: skip
    assert trainer.train().global_step == 3
    rows = [r for r in _rows(tmp_path) if "pools/new/size" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        sizes = sum(r[f"pools/{p}/size"] for p in ("new", "hard", "medium", "easy"))
        assert sizes + r["pools/retired"] == n
    state = json.loads((tmp_path / "out" / "checkpoint-3" / "rollout_state.json").read_text())
    pools = state["pools"]
    check_pools_state(state)
    assert sum(pools["groups"].values()) == pools["applied"] > 0  # every settled group was scored
    counted = {int(p) for p in pools["groups"]}
    assert {int(p) for p in pools["retired"]} == {p for p in counted if p % 2 == 0}  # solved rows retired
    assert all(pools["rate"][str(p)] == 0.0 for p in counted if p % 2 == 1)
    assert {int(p) for p in pools["parked"]} == {p for p in counted if p % 2 == 1}
    assert rows[-1]["pools/retired"] == len(pools["retired"])
    # The worker drew the rows the reward function saw; a retired row is drawn again only while its group was
    # still in flight or unsettled (the worker's pools learn a group two draws after it was drawn).
    seen = [json.loads(line)["row"] for line in record.read_text().splitlines()]
    assert counted <= set(seen)

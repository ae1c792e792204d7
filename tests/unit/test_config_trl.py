"""Issue 43: every field of TRL 1.16's async GRPO config is accepted at TRL's defaults, with its documented effect.

The field list is TRL's own, read from the 1.16 wheel by ``tests/data/trl_1_16_fields.py`` (committed JSON); the
six fields this library lacked are checked for their effect here and, with real processes, in
``tests/integration/test_trl_compat_cpu.py`` and ``test_trl_server_cpu.py``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.client.pool import ServerPool
from asyncgrpo.config_trl import TRL_FIELDS, describe_aliases
from asyncgrpo.rollout.reconcile import ReconcileStats, rollout_to_sequences
from asyncgrpo.trainer.server_setup import ServerFacts
from asyncgrpo.trainer.worker_settings import build_rollout_settings
from asyncgrpo.types import Rollout, TurnRecord

TRL = json.loads((Path(__file__).parents[1] / "data" / "trl_1_16_async_grpo_config.json").read_text())
FACTS = ServerFacts(model_name="policy", max_model_len=4096, kv_cache_tokens=8192, has_metrics=True,
                    masks_supported=True, world_size=1, dtype=None, weight_backend=None)  # fmt: skip
# TRL 1.16's defaults that ours resolves further, as its own docstring says it does too.
RESOLVED = {
    "epsilon_high": lambda cfg: cfg.epsilon_high == cfg.epsilon,  # "defaults to the same value as epsilon"
    "bf16": lambda cfg: isinstance(cfg.bf16, bool),  # None: True where a bf16 accelerator is visible
}


def _trl_defaults() -> dict:
    values = {f["name"]: f["default"] for f in TRL["base_fields"]}
    values.update({f["name"]: f["default"] for f in TRL["fields"]})  # the async config's own win
    return values


def test_the_fixture_is_the_1_16_wheels_field_list():
    assert TRL["wheel"] == "trl-1.16.0-py3-none-any.whl" and len(TRL["sha256"]) == 64
    names = [f["name"] for f in TRL["fields"]]
    assert set(TRL_FIELDS) <= set(names) and len(names) == len(set(names)) >= 30


def test_a_trl_1_16_config_at_trl_defaults_is_accepted_field_by_field(tmp_path, caplog):
    values = _trl_defaults()
    with caplog.at_level(logging.WARNING):
        cfg = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], **values)
    ours = {f.name for f in dataclasses.fields(cfg)}
    for name, default in values.items():
        assert name in ours, f"TRL 1.16 field {name} is unknown to AsyncGRPOConfig"
        if name in RESOLVED:
            assert RESOLVED[name](cfg), name
        else:
            assert getattr(cfg, name) == default, name
    # The aliases at TRL's defaults set nothing: ours keep their values, and no start line is printed.
    assert cfg.max_concurrent_rollouts == 512 and cfg.rollout_worker_timeout == 300.0
    assert describe_aliases(cfg) is None
    # The behaviours reach the rollout worker's settings and the client.
    st = build_rollout_settings(cfg, FACTS, start_index=0, token_budget=4096, eos_token_id=None)
    assert (st.request_timeout_s, st.queue_maxsize, st.fork_threshold_tokens) == (600, 1024, 1024)
    pool = ServerPool(cfg.server_urls, timeout=st.request_timeout_s, max_connections=4)
    assert [(c.timeout, c.timeout_name) for c in pool.clients] == [(600, "request_timeout")]
    assert pool.clients[0].clone().timeout_name == "request_timeout"
    # fork_threshold_tokens=1024: a 2-token drift inside the last answer realigns (one sequence, no fork).
    stats = ReconcileStats()
    (_seq,) = _seqs(_drift_turns(), cfg.fork_threshold_tokens, stats)
    assert (stats.realigns, stats.forks) == (1, 0)


def test_output_dir_stays_the_first_positional_field(tmp_path):
    cfg = AsyncGRPOConfig(str(tmp_path / "run"))  # TRL 1.16's trainer builds its default config this way
    assert cfg.output_dir == str(tmp_path / "run") and cfg.max_inflight_tasks == -1


def test_the_trainer_and_protocols_have_trl_1_16s_names():
    import inspect

    from asyncgrpo import AsyncGRPOTrainer
    from asyncgrpo.trainer.trl_weights import WEIGHT_TRANSFER_METHODS
    from asyncgrpo.trainer.trl_worker import ROLLOUT_WORKER_METHODS

    ours = list(inspect.signature(AsyncGRPOTrainer.__init__).parameters)[1:]
    assert ours[: len(TRL["trainer_init"])] == TRL["trainer_init"]  # same names, same positions
    assert list(ROLLOUT_WORKER_METHODS) == TRL["rollout_worker_protocol"]
    assert list(WEIGHT_TRANSFER_METHODS) == TRL["weight_transfer_protocol"]


def test_our_defaults_keep_our_behaviour(tmp_path):
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[])
    assert (cfg.max_inflight_tasks, cfg.heartbeat_stale_after_s, cfg.fork_threshold_tokens) == (-1, 300.0, 0)
    assert (cfg.request_timeout, cfg.weight_sync_timeout, cfg.queue_maxsize) == (600.0, 1800.0, 1024)
    stats = ReconcileStats()
    assert len(_seqs(_drift_turns(), cfg.fork_threshold_tokens, stats)) == 2 and stats.forks == 1


def test_an_alias_sets_ours_and_the_start_line_says_so(tmp_path):
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], max_inflight_tasks=24, heartbeat_stale_after_s=45)
    assert cfg.max_concurrent_rollouts == 24 and cfg.rollout_worker_timeout == 45.0
    line = describe_aliases(cfg)
    assert line == ("TRL 1.16 names in the config: max_inflight_tasks=24 -> max_concurrent_rollouts=24; "
                    "heartbeat_stale_after_s=45 -> rollout_worker_timeout=45.0")  # fmt: skip
    # Our name alone: the TRL name reads the same value (it is the same setting).
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], rollout_worker_timeout=60.0)
    assert cfg.heartbeat_stale_after_s == 60.0 and describe_aliases(cfg) is None
    # Both names, the same value: accepted.
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], max_inflight_tasks=8, max_concurrent_rollouts=8)
    assert cfg.max_concurrent_rollouts == 8


@pytest.mark.parametrize(
    ("kw", "line"),
    [
        ({"max_inflight_tasks": 64, "max_concurrent_rollouts": 32},
         ("max_inflight_tasks=64 and max_concurrent_rollouts=32: max_inflight_tasks is TRL 1.16's name of "
         "max_concurrent_rollouts; set only one of them")),
        ({"heartbeat_stale_after_s": 30.0, "rollout_worker_timeout": 90.0},
         ("heartbeat_stale_after_s=30.0 and rollout_worker_timeout=90.0: heartbeat_stale_after_s is TRL 1.16's name "
         "of rollout_worker_timeout; set only one of them")),
        ({"max_inflight_tasks": 0}, "max_inflight_tasks=0: must be >= 1, or -1 for auto"),
        ({"request_timeout": 0}, "request_timeout=0: must be > 0 seconds"),
        ({"weight_sync_timeout": -1}, "weight_sync_timeout=-1: must be > 0 seconds"),
        ({"queue_maxsize": -1}, "queue_maxsize=-1: must be >= 0 (0 = no bound)"),
    ],
)  # fmt: skip
def test_conflicts_and_bad_values_are_refused_in_one_line(tmp_path, kw, line):
    with pytest.raises(ValueError) as info:
        AsyncGRPOConfig(output_dir=str(tmp_path), report_to=[], **kw)
    assert str(info.value).splitlines()[1:] == [f"  - {line}"]


# ---- fork_threshold_tokens (rollout/reconcile.py), against turns built by hand


def _seqs(turns, threshold, stats=None):
    r = Rollout(completion=[], completion_ids=[], turns=turns)
    return rollout_to_sequences(r, group_id=0, row_index=0, model_version=0, num_sampler_logprobs=None, stats=stats,
                                fork_threshold_tokens=threshold)  # fmt: skip


def _drift_turns():
    """Turn 2's prompt re-renders the last 2 answer tokens of turn 1 (7, 8 -> 70): a drift inside the answer."""
    t1 = TurnRecord(prompt_ids=[1, 2], output_ids=[5, 6, 7, 8], output_log_probs=[-0.5, -0.6, -0.7, -0.8])
    t2 = TurnRecord(prompt_ids=[1, 2, 5, 6, 70, 9], output_ids=[10, 11], output_log_probs=[-1.0, -1.1])
    return [t1, t2]


def test_a_drift_under_the_threshold_realigns_the_answer_as_context():
    stats = ReconcileStats()
    (s,) = _seqs(_drift_turns(), 3, stats)
    # held [1 2 | 5 6 7 8]; common prefix 4, drift 2 < 3 -> cut to [1 2 5 6], then context [70 9], answer [10 11]
    assert s.input_ids == [1, 2, 5, 6, 70, 9, 10, 11]
    assert s.loss_mask == [0, 0, 1, 1, 0, 0, 1, 1]
    assert s.sampler_logprobs == [0.0, 0.0, -0.5, -0.6, 0.0, 0.0, -1.0, -1.1]
    assert (stats.transitions, stats.realigns, stats.forks, stats.drift_tokens) == (1, 1, 0, [2])
    s.validate()


def test_a_drift_at_the_threshold_forks_and_one_before_the_answer_always_forks():
    stats = ReconcileStats()
    a, b = _seqs(_drift_turns(), 2, stats)  # drift 2 is not < 2
    assert a.input_ids == [1, 2, 5, 6, 7, 8] and b.input_ids == [1, 2, 5, 6, 70, 9, 10, 11]
    assert sum(a.loss_mask) + sum(b.loss_mask) == 6 and stats.forks == 1
    t1 = TurnRecord(prompt_ids=[1, 2], output_ids=[5], output_log_probs=[-0.5])
    t2 = TurnRecord(prompt_ids=[1, 99, 5, 9], output_ids=[10], output_log_probs=[-1.0])  # drift in the prompt
    stats = ReconcileStats()
    assert len(_seqs([t1, t2], 1000, stats)) == 2 and (stats.forks, stats.realigns) == (1, 0)


def test_a_realign_cuts_the_answers_top_n_and_candidate_sets_with_it():
    t1 = TurnRecord(prompt_ids=[1], output_ids=[5, 6, 7], output_log_probs=[-0.5, -0.6, -0.7],
                    output_sampler_logprobs=[{5: -0.5}, {6: -0.6}, {7: -0.7}],
                    output_sampling_mask=[[5], [6, 3], [7]])  # fmt: skip
    t2 = TurnRecord(prompt_ids=[1, 5, 6, 71], output_ids=[8], output_log_probs=[-0.8],
                    output_sampler_logprobs=[{8: -0.8}], output_sampling_mask=[[8, 2]])  # fmt: skip
    r = Rollout(completion=[], completion_ids=[], turns=[t1, t2])
    (s,) = rollout_to_sequences(r, group_id=0, row_index=0, model_version=0, num_sampler_logprobs=1,
                                fork_threshold_tokens=5)  # fmt: skip
    assert s.input_ids == [1, 5, 6, 71, 8] and s.loss_mask == [0, 1, 1, 0, 1]
    assert s.sampler_top_ids == [[], [5], [6], [], [8]]
    assert s.candidate_sets == [[], [5], [6, 3], [], [8, 2]]
    s.validate()

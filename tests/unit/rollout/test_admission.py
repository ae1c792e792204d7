"""G3/G5 admission rules, checked step by step against the arithmetic of docs/spec.md."""

import pytest

from asyncgrpo.rollout.admission import ConcurrencyCap, StalenessAdmission


def test_one_group_at_a_time_until_the_first_completes():
    adm = StalenessAdmission(max_staleness=4, initial_tokens_per_step=1000)
    assert adm.can_start_group()
    adm.on_group_started()
    assert not adm.can_start_group()  # rollout length unknown
    adm.on_group_finished(tokens=300, kept_tokens=300)
    assert adm.can_start_group()


def test_token_limit_before_and_after_the_first_step():
    # Before the first step: limit = max(4, 1) * 1000 = 4000 tokens.
    adm = StalenessAdmission(max_staleness=4, initial_tokens_per_step=1000)
    adm.on_group_started()
    adm.on_group_finished(tokens=500, kept_tokens=500)  # estimate 500 tokens/group, queued 500
    started = 0
    while adm.can_start_group():
        adm.on_group_started()
        started += 1
    # a group starts while it keeps the total within the limit: 500 + 500 * k + 500 <= 4000 for k = 0..6 -> 7 start.
    assert started == 7
    assert adm.outstanding_tokens == 500 + 7 * 500
    # The trainer reports a step that used only 600 tokens (nothing pulled yet): limit = 2400; nothing may start.
    adm.on_trainer_report(consumed_tokens=0, tokens_per_step=600)
    assert adm.limit == 2400
    assert not adm.can_start_group()
    # The trainer pulls the queued 500 and 4 groups finish with everything dropped (zero std).
    adm.on_trainer_report(consumed_tokens=500, tokens_per_step=600)
    for _ in range(4):
        adm.on_group_finished(tokens=500, kept_tokens=0)
    assert adm.queued_tokens == 0
    assert adm.outstanding_tokens == 3 * 500
    assert adm.can_start_group()  # 1500 + 500 <= 2400
    adm.on_group_started()
    assert not adm.can_start_group()  # 2000 < 2400, but another 500 would pass the limit


def test_a_group_larger_than_the_whole_allowance_starts_alone():
    adm = StalenessAdmission(max_staleness=1, initial_tokens_per_step=300)
    adm.on_group_started()
    adm.on_group_finished(tokens=500, kept_tokens=500)  # one group is larger than the allowance (300)
    assert not adm.can_start_group()  # 500 queued
    adm.on_trainer_report(consumed_tokens=500, tokens_per_step=0)
    assert adm.outstanding_tokens == 0 and adm.can_start_group()  # nothing outstanding: it may run
    adm.on_group_started()
    assert not adm.can_start_group()


def test_queued_tokens_follow_the_trainers_running_total():
    # The worker counts what it enqueues; the trainer reports the running total it pulled. A report of
    # "no step yet" (tokens_per_step=0) keeps the first-step assumption.
    adm = StalenessAdmission(max_staleness=2, initial_tokens_per_step=1000)
    for kept in (300, 200, 0):
        adm.on_group_started()
        adm.on_group_finished(tokens=400, kept_tokens=kept)
    assert adm.queued_tokens == 500
    adm.on_trainer_report(consumed_tokens=300, tokens_per_step=0)
    assert adm.queued_tokens == 200 and adm.limit == 2000
    adm.on_trainer_report(consumed_tokens=500, tokens_per_step=450)
    assert adm.queued_tokens == 0 and adm.limit == 900
    # Reports are totals, not increments: repeating one changes nothing.
    adm.on_trainer_report(consumed_tokens=500, tokens_per_step=450)
    assert adm.queued_tokens == 0
    assert adm.outstanding_tokens == 0  # no group in flight


def test_finishing_a_group_that_never_started_is_an_error():
    adm = StalenessAdmission(max_staleness=1, initial_tokens_per_step=10)
    with pytest.raises(RuntimeError, match="on_group_started"):
        adm.on_group_finished(tokens=1, kept_tokens=1)


def test_zero_staleness_still_allows_one_step_of_tokens():
    adm = StalenessAdmission(max_staleness=0, initial_tokens_per_step=100)
    assert adm.limit == 100


def test_bad_initial_tokens():
    with pytest.raises(ValueError, match="initial_tokens_per_step"):
        StalenessAdmission(max_staleness=1, initial_tokens_per_step=0)


def test_concurrency_cap_starts_from_kv_capacity_and_follows_usage():
    cap = ConcurrencyCap(max_concurrent_rollouts=512, kv_cache_tokens=40_960, max_model_len=4096, has_metrics=True)
    assert cap.cap == 10  # 40960 / 4096
    # Low usage but fewer completions than the cap: no raise yet.
    for _ in range(9):
        cap.on_rollout_completed()
    assert cap.on_metrics(kv_cache_usage=0.3, num_waiting=0) == 10
    cap.on_rollout_completed()
    assert cap.on_metrics(kv_cache_usage=0.3, num_waiting=0) == 12  # floor(10 * 1.25)
    # Requests queued on the server: no raise even with low usage.
    for _ in range(12):
        cap.on_rollout_completed()
    assert cap.on_metrics(kv_cache_usage=0.3, num_waiting=3) == 12
    # Mid usage: unchanged; high usage: -30 %.
    assert cap.on_metrics(kv_cache_usage=0.7, num_waiting=0) == 12
    assert cap.on_metrics(kv_cache_usage=0.9, num_waiting=0) == 8  # floor(12 * 0.7)


def test_concurrency_cap_bounds():
    cap = ConcurrencyCap(max_concurrent_rollouts=4, kv_cache_tokens=10**9, max_model_len=10, has_metrics=True)
    assert cap.cap == 4
    small = ConcurrencyCap(max_concurrent_rollouts=64, kv_cache_tokens=100, max_model_len=4096, has_metrics=True)
    assert small.cap == 1
    for _ in range(5):
        assert small.on_metrics(kv_cache_usage=0.99, num_waiting=0) == 1
    small.on_rollout_completed()
    assert small.on_metrics(kv_cache_usage=0.1, num_waiting=0) == 2  # growth of at least one


def test_no_metrics_means_the_hard_bound():
    cap = ConcurrencyCap(max_concurrent_rollouts=32, kv_cache_tokens=None, max_model_len=4096, has_metrics=False)
    assert cap.cap == 32
    assert cap.on_metrics(kv_cache_usage=0.99, num_waiting=10) == 32

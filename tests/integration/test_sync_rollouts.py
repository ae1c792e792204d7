"""``sync_rollouts``: the worker starts groups only while the trainer waits for samples (the B6 baseline).

A real worker process runs a real ``AsyncRolloutLoop`` against a real server; the test plays the trainer's part
by opening and closing the gate the way ``RolloutSource.next_step`` does.
"""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.sampling import SamplingSettings
from asyncgrpo.rollout.settings import RolloutSettings
from asyncgrpo.rollout.worker import RolloutWorker
from tests.helpers.rewards import even_token_reward

ROWS = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(64)]


def _worker(base_url: str, model_dir, sync: bool, parse_processes: int = 0) -> RolloutWorker:
    sampling = SamplingSettings(base_url, max_model_len=512, max_completion_length=6, temperature=1.0)
    settings = RolloutSettings(model_name=None, sampling=sampling, num_generations=2, max_staleness=1, seed=0,
                               max_concurrent_rollouts=8, initial_tokens_per_step=64, sync_rollouts=sync,
                               answer_parse_processes=parse_processes)  # fmt: skip
    tok = AutoTokenizer.from_pretrained(model_dir)
    return RolloutWorker(AsyncRolloutLoop(settings, ROWS, [even_token_reward], tok), heartbeat_timeout=60)


def _pull(w: RolloutWorker, timeout: float = 60.0):
    """What the trainer does with a sample: take it and report its tokens consumed (frees the staleness allowance)."""
    res = w.get_sample(timeout=timeout)
    w.report_consumed(res.tokens)
    w.channels.count_queued(-len(res.sequences))
    return res


def _settled_count(w: RolloutWorker, quiet_s: float = 1.5, timeout: float = 30.0) -> int:
    """Queued samples once the count stops changing for ``quiet_s`` (in-flight groups have landed)."""
    deadline = time.monotonic() + timeout
    last, since = w.queue_size(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = w.queue_size()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    raise TimeoutError(f"the rollout worker's queue kept growing for {timeout}s with the gate closed")


@pytest.fixture(scope="module")
def server(serve, tiny_llama_dir):
    return serve(tiny_llama_dir)


def test_sync_worker_generates_only_while_the_trainer_waits(server, tiny_llama_dir):
    w = _worker(server.base_url, tiny_llama_dir, sync=True)
    w.start()
    try:
        time.sleep(2.0)
        assert w.queue_size() == 0, "a sync_rollouts worker started a group while the trainer was not waiting"
        w.set_trainer_waiting(True)
        assert _pull(w).sequences
        w.set_trainer_waiting(False)
        settled = _settled_count(w)  # groups already started may finish, nothing new starts
        time.sleep(2.0)
        assert w.queue_size() == settled
        for _ in range(settled):
            _pull(w, timeout=5)
        w.set_trainer_waiting(True)
        assert _pull(w).sequences  # the gate opens again: generation resumes
        w.check()
    finally:
        w.stop()


def test_async_worker_generates_without_the_gate(server, tiny_llama_dir):
    """Also: a worker with an answer-parsing helper (started at setup, closed with the loop) runs and stops."""
    w = _worker(server.base_url, tiny_llama_dir, sync=False, parse_processes=1)
    w.start()
    try:
        assert w.get_sample(timeout=60) is not None  # nobody opened the gate
    finally:
        t0 = time.monotonic()
        w.stop()
    assert time.monotonic() - t0 < 20

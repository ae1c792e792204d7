"""The final held-out evaluation runs on a server no longer busy with rollouts nobody will train on."""

from __future__ import annotations

from types import SimpleNamespace

from asyncgrpo.trainer.trainer import AsyncGRPOTrainer


class _Worker:
    def __init__(self) -> None:
        self.stopped = False

    def drain_metrics(self) -> list[tuple[str, float, float]]:
        return [("rollout/queue_size", 3.0, 1.0)]

    def stop(self) -> None:
        self.stopped = True


def _trainer(global_step: int, max_steps: int) -> SimpleNamespace:
    return SimpleNamespace(state=SimpleNamespace(global_step=global_step, max_steps=max_steps), worker=_Worker(),
                           window=[])  # fmt: skip


def test_the_worker_stops_before_the_evaluation_after_the_last_step():
    t = _trainer(global_step=8, max_steps=8)
    worker = t.worker
    AsyncGRPOTrainer._end_generation_after_last_step(t)
    assert worker.stopped and t.worker is None
    assert t.window == [("rollout/queue_size", 3.0, 1.0)]  # its last metrics still reach the log


def test_an_evaluation_mid_run_leaves_the_worker_generating():
    for step, max_steps in ((0, 8), (4, 8), (3, -1)):  # eval_on_start, a mid-run eval, an epoch-bounded run
        t = _trainer(step, max_steps)
        AsyncGRPOTrainer._end_generation_after_last_step(t)
        assert t.worker is not None and not t.worker.stopped

"""A step whose groups carry no signal says why early, naming the likely cause (issue 30, items 3 and 6).

The trainer's side is real (``RolloutSource``, its waiting line, the ``/health`` probe against a real socket);
the worker is played by ``TiedWorker``, which sends a dropped group every few milliseconds, as a worker does when
every completion of a group scores the same.
"""

from __future__ import annotations

import logging
import socket
import time

import pytest

from asyncgrpo.packing import TokenBudgetBatcher
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.trainer import rollout_source
from asyncgrpo.trainer.no_signal import StepGroups, likely_cause
from asyncgrpo.trainer.rollout_source import NoTrainableSamplesError, RolloutSource
from tests.helpers.scripted_workers import QuietWorker

NOTICE_S = 0.3  # the first notice, scaled down from FIRST_NOTICE_S (20 s) to keep the test short


class TiedWorker(QuietWorker):
    """Dropped groups (equal rewards ``rewards(i)``, ``tool_calls`` calls each) every ``every_s`` seconds."""

    def __init__(self, rewards, tool_calls: int | None, every_s: float = 0.01) -> None:
        super().__init__()
        self.rewards, self.tool_calls, self.every_s = rewards, tool_calls, every_s
        self.sent = 0

    def get_sample(self, timeout: float) -> GroupResult:
        time.sleep(self.every_s)
        self.sent += 1
        return GroupResult(self.sent - 1, 0, self.sent, 0, [], dropped=True, rewards=self.rewards(self.sent),
                           tool_calls=self.tool_calls)  # fmt: skip


def _dead_url() -> str:
    """A local address where nothing listens (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _first_notice(worker: TiedWorker, caplog, monkeypatch, urls=()) -> tuple[str, float, str]:
    """Run one step until the tie bound stops it; the first waiting line, when it came, and the final error."""
    monkeypatch.setattr(rollout_source, "FIRST_NOTICE_S", NOTICE_S)
    source = RolloutSource(worker, TokenBudgetBatcher(256, 1, keep_groups=True), 1, 4, 10_000,
                           zero_std_patience=80, server_urls=urls)  # fmt: skip
    t0 = time.monotonic()
    stamps: list[float] = []

    class Stamp(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            stamps.append(time.monotonic() - t0)

    handler = Stamp(logging.WARNING)
    logging.getLogger("asyncgrpo.trainer.rollout_source").addHandler(handler)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="asyncgrpo.trainer.rollout_source"),
            pytest.raises(NoTrainableSamplesError) as err,
        ):
            source.next_step(0)
    finally:
        logging.getLogger("asyncgrpo.trainer.rollout_source").removeHandler(handler)
    lines = [r.getMessage() for r in caplog.records]
    assert lines, "no waiting line while groups kept arriving"
    return lines[0], stamps[0], str(err.value)


def test_a_run_without_tool_calls_says_so_while_groups_keep_arriving(caplog, monkeypatch):
    line, at, error = _first_notice(TiedWorker(lambda i: [0.0] * 4, tool_calls=0), caplog, monkeypatch)
    assert at < NOTICE_S + 0.5, at  # the groups that keep arriving do not hold the line back
    assert "called a tool" in line and "supervised_tool_warmup" in line, line
    assert "called a tool" in error


def test_a_constant_reward_is_named(caplog, monkeypatch):
    line, _, _ = _first_notice(TiedWorker(lambda i: [1.0] * 4, tool_calls=None), caplog, monkeypatch)
    assert "every completion scored 1: the reward is constant" in line, line


def test_groups_tied_on_different_values_are_saturated_prompts(caplog, monkeypatch):
    line, _, _ = _first_notice(TiedWorker(lambda i: [float(i % 2)] * 4, tool_calls=None), caplog, monkeypatch)
    assert "each group's completions tie (group rewards 0, 1)" in line, line


def test_a_dead_server_is_never_called_a_reward_problem(caplog, monkeypatch):
    url = _dead_url()
    line, _, error = _first_notice(TiedWorker(lambda i: [0.0] * 4, tool_calls=0), caplog, monkeypatch, urls=[url])
    for text in (line, error):
        assert f"the generation server {url} does not answer /health" in text, text
        assert "constant" not in text and "saturated" not in text and "tool" not in text, text


def test_likely_cause_orders_the_causes():
    tied = StepGroups()
    for _ in range(3):
        tied.add(True, [0.0, 0.0], tool_calls=0)
    assert "/health" in likely_cause(tied, ["http://x:1"])
    assert "called a tool" in likely_cause(tied, [])
    mixed = StepGroups()
    mixed.add(True, [0.0, 0.0], None)
    mixed.add(False, [0.0, 1.0], None)
    assert likely_cause(mixed, []) == ""  # a trainable group arrived: nothing to explain
    assert likely_cause(StepGroups(), []) == ""  # nothing scored yet: generation is just slow
    one = StepGroups()
    one.add(True, [0.0] * 8, tool_calls=None)
    assert likely_cause(one, []) == ""  # one tied group happens by chance: no verdict yet
    one_tool = StepGroups()
    one_tool.add(True, [0.0] * 8, tool_calls=0)
    assert "called a tool" in likely_cause(one_tool, [])  # but a whole group without a tool call is telling

"""The end-of-data marker follows the last group at once, and a group that fails at the end still stops the run.

The loop used to poll its last groups every 50 ms, so the marker (which ends a run, and every timed worker run of
``bench/rollout_path.py``) came up to 50 ms after the last sample. Here the poll interval is raised to 10 s: the
marker must still come right after the slowest group, so the wait is woken by the group ending, not by a timer.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from asyncgrpo.rollout import production as production_module
from asyncgrpo.rollout.admission import StalenessAdmission
from asyncgrpo.rollout.messages import GroupResult
from asyncgrpo.rollout.production import GroupOutcome, GroupProducer
from asyncgrpo.rollout.prompt_order import PromptItem, PromptOrder


class _Samples:
    def __init__(self) -> None:
        self.items: list[tuple[float, GroupResult]] = []

    def put(self, item: GroupResult) -> None:
        self.items.append((time.monotonic(), item))


class _Channels:
    def __init__(self) -> None:
        self.samples = _Samples()
        self.stop = threading.Event()


class _TimedGroups(GroupProducer):
    """Groups that take ``durations[i]`` seconds each and then hand in a marker sample; the last one may fail."""

    def __init__(self, durations: list[float], fail_last: bool = False) -> None:
        self.durations = durations
        self.fail_last = fail_last
        self.ended: list[float] = []
        dataset = [{"prompt": f"p{i}"} for i in range(len(durations))]
        super().__init__(PromptOrder(dataset, 0, 1), _Channels(), StalenessAdmission(1000, 10**9),
                         accept=lambda item: True, run_group=self._timed_group)  # fmt: skip

    async def _wait_for_admission(self) -> None:
        return None

    async def _timed_group(self, item: PromptItem, group_id: int) -> GroupOutcome:
        await asyncio.sleep(self.durations[group_id])
        self.ended.append(time.monotonic())
        if self.fail_last and group_id == len(self.durations) - 1:
            raise RuntimeError("reward function failed on the last group")
        self.channels.samples.put(GroupResult(row_index=item.flat_index, epoch=item.epoch))
        return GroupOutcome(0, 0)


def test_end_of_data_follows_the_last_group_without_waiting_for_a_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(production_module, "END_POLL_S", 10.0)
    loop = _TimedGroups([0.05, 0.3, 0.1])
    t0 = time.monotonic()
    asyncio.run(asyncio.wait_for(loop.run(), timeout=20))
    items = loop.channels.samples.items
    assert [it.end for _, it in items] == [False, False, False, True]
    last_group_end = max(loop.ended)
    marker_at = items[-1][0]
    assert marker_at - last_group_end < 2.0, f"the end marker came {marker_at - last_group_end:.2f} s late"
    assert marker_at - t0 < 5.0


def test_a_group_failing_last_stops_the_run_instead_of_ending_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(production_module, "END_POLL_S", 10.0)
    loop = _TimedGroups([0.02, 0.1], fail_last=True)
    with pytest.raises(RuntimeError, match="failed on the last group"):
        asyncio.run(asyncio.wait_for(loop.run(), timeout=20))
    assert not any(it.end for _, it in loop.channels.samples.items)  # no end marker after a failure

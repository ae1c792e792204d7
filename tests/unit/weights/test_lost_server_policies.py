"""The weight sender's two lost-server policies (``weights/lost_server.py``) against a scripted sender.

The sender is a stand-in holding scripted servers: each answers ``/weight_info`` and ``/health`` as the test says,
and the stand-in records what the policy asked of it (a re-form, a drop), so each rule of the policies' docstring
is checked on its own, without a transfer group.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from asyncgrpo.errors import ServerError, WeightTransferError
from asyncgrpo.weights.lost_server import DropDeadServers, RestartRecovery


class ScriptedServer:
    def __init__(self, url: str, weight_info: Any, healthy: list[bool]) -> None:
        self.base_url, self.weight_info, self.healthy = url, weight_info, healthy

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        assert (method, path, kwargs.get("retries")) == ("GET", "/weight_info", 0)
        if isinstance(self.weight_info, BaseException):
            raise self.weight_info
        return self.weight_info

    async def health(self) -> bool:
        return self.healthy.pop(0) if len(self.healthy) > 1 else self.healthy[0]


class Link:
    def __init__(self, server: ScriptedServer) -> None:
        self.client, self.url = server, server.base_url


class ScriptedSender:
    def __init__(self, *servers: ScriptedServer, pushed: str | None = None) -> None:
        self.links = {s.base_url: Link(s) for s in servers}
        self.pushed = {s.base_url: pushed for s in servers if pushed is not None}
        self.shared, self.restarts, self.reforms, self.dropped = None, 0, 0, []

    def _loop_run(self, coro: Any, timeout: float, what: str) -> Any:
        return asyncio.run(coro)

    def _http(self, coro: Any, what: str) -> Any:
        return asyncio.run(coro)

    def reform(self) -> None:
        self.reforms += 1

    def gone(self, url: str) -> bool:
        return not asyncio.run(self.links[url].client.health())

    def drop(self, url: str, reason: str) -> None:
        self.links.pop(url)
        self.dropped.append((url, reason))


def test_restart_recovery_reforms_for_a_server_that_serves_other_weights():
    sender = ScriptedSender(ScriptedServer("http://a", {"weight_version": "0"}, [True]), pushed="step-3")
    RestartRecovery(restart_timeout_s=5).before_round(sender)
    assert (sender.reforms, sender.restarts) == (1, 1)
    same = ScriptedSender(ScriptedServer("http://a", {"weight_version": "step-3"}, [True]), pushed="step-3")
    RestartRecovery(restart_timeout_s=5).before_round(same)
    assert same.reforms == 0
    other_error = ScriptedSender(ScriptedServer("http://a", ServerError("GET /weight_info", 404, "no"), [True]))
    RestartRecovery(restart_timeout_s=5).before_round(other_error)  # a real vLLM without /weight_info
    assert other_error.reforms == 0


def test_restart_recovery_repeats_a_round_once_after_the_server_came_back(monkeypatch):
    monkeypatch.setattr("asyncgrpo.weights.lost_server.RESTART_POLL_S", 0.0)
    sender = ScriptedSender(ScriptedServer("http://a", {}, [False, False, True]))
    calls = []

    def once() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise WeightTransferError("broadcast failed")
        return "pushed"

    assert RestartRecovery(restart_timeout_s=5).run(sender, once, replayable=True) == "pushed"
    assert (len(calls), sender.reforms, sender.restarts) == (2, 1, 1)
    with pytest.raises(WeightTransferError, match="broadcast failed"):  # other ranks joined: never replayed alone
        RestartRecovery(restart_timeout_s=5).run(ScriptedSender(ScriptedServer("http://a", {}, [False])),
                                                 lambda: (_ for _ in ()).throw(WeightTransferError("broadcast failed")),
                                                 replayable=False)  # fmt: skip


def test_restart_recovery_gives_up_after_restart_timeout(monkeypatch):
    monkeypatch.setattr("asyncgrpo.weights.lost_server.RESTART_POLL_S", 0.0)
    sender = ScriptedSender(ScriptedServer("http://a", ServerError("GET /weight_info", None, "refused"), [False]))
    with pytest.raises(WeightTransferError, match="server http://a gone since"):
        RestartRecovery(restart_timeout_s=0.05).before_round(sender)
    assert sender.reforms == 0


def test_drop_dead_servers_drops_the_silent_and_the_restarted_and_keeps_the_rest():
    silent = ScriptedServer("http://a", ServerError("GET /weight_info", None, "refused"), [False])
    restarted = ScriptedServer("http://b", {"weight_version": "0"}, [True])
    fine = ScriptedServer("http://c", {"weight_version": "step-2"}, [True])
    sender = ScriptedSender(silent, restarted, fine, pushed="step-2")
    DropDeadServers().before_round(sender)
    assert list(sender.links) == ["http://c"]
    assert [u for u, _ in sender.dropped] == ["http://a", "http://b"]
    assert "it restarted" in sender.dropped[1][1]


def test_drop_dead_servers_fails_the_round_on_a_server_that_still_answers():
    sender = ScriptedSender(ScriptedServer("http://a", {}, [True]), ScriptedServer("http://b", {}, [False]))
    policy = DropDeadServers()
    with pytest.raises(WeightTransferError, match="weight sync to http://a failed"):
        policy.lost(sender, sender.links["http://a"], ServerError("POST /pause", 500, "boom"))
    policy.lost(sender, sender.links["http://b"], ServerError("POST /pause", None, "refused"))
    assert list(sender.links) == ["http://a"] and sender.dropped[0][0] == "http://b"
    assert policy.run(sender, lambda: 7, replayable=True) == 7  # a dropped server is never waited for

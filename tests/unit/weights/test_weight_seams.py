"""The weight sync's two seams (``weights/base.py``) hold against the classes that fill them.

``ServerControl`` is what ``weights/`` calls on a server; the wiring hands it ``AsyncServerClient``s, which
``weights/`` never imports, so nothing but this test notices a renamed method or a changed signature.
``WeightSync`` is what the trainer calls; each kind of weight sync must offer it.
"""

from __future__ import annotations

import inspect

import pytest

from asyncgrpo.client.http_client import AsyncServerClient
from asyncgrpo.weights.base import ServerControl, WeightSync
from asyncgrpo.weights.lora_sync import AdapterFollower, AdapterPublisher, AdapterSyncSettings
from asyncgrpo.weights.policy import GatherFollower
from asyncgrpo.weights.sender import WeightSender


def _members(protocol: type) -> list[str]:
    names = {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))
    return sorted(n for n in names if not n.startswith("_"))


def _check_signature(declared: inspect.Signature, real: inspect.Signature, where: str) -> None:
    """Every declared parameter exists in the real one with the same kind and, when declared optional, optional
    there too; the real one's extra parameters all have defaults (a caller of the declaration never passes them)."""
    real_params = real.parameters
    for name, p in declared.parameters.items():
        assert name in real_params, f"{where}: no parameter {name!r}"
        q = real_params[name]
        assert q.kind == p.kind, f"{where}: {name!r} is {q.kind}, declared {p.kind}"
        if p.default is not inspect.Parameter.empty:
            assert q.default is not inspect.Parameter.empty, f"{where}: {name!r} has no default"
    for name, q in real_params.items():
        if name not in declared.parameters and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD):
            assert q.default is not inspect.Parameter.empty, f"{where}: extra required parameter {name!r}"


@pytest.mark.parametrize("name", _members(ServerControl))
def test_the_http_client_offers_every_call_the_weight_sync_makes(name):
    declared = getattr(ServerControl, name, None)
    if declared is None or not callable(declared):  # an attribute: the client sets it per instance
        client = AsyncServerClient("http://127.0.0.1:9")
        assert isinstance(getattr(client, name), str)
        return
    real = getattr(AsyncServerClient, name, None)
    assert real is not None, f"AsyncServerClient has no {name}"
    assert inspect.iscoroutinefunction(real) == inspect.iscoroutinefunction(declared), f"{name}: async differs"
    _check_signature(inspect.signature(declared), inspect.signature(real), f"AsyncServerClient.{name}")


def test_the_declared_calls_are_the_ones_the_senders_make():
    """Reference: the method names the weight sync's modules call on a client, read from their source."""
    import re
    from pathlib import Path

    from asyncgrpo import weights

    called = set()
    for path in Path(weights.__path__[0]).glob("*.py"):
        called |= set(re.findall(r"\b(?:client|c|link\.client)\.(\w+)\(", path.read_text()))
    assert called, "no client call found: the pattern no longer matches the sources"
    assert called <= set(_members(ServerControl)), f"called but not declared: {called - set(_members(ServerControl))}"


def _publisher() -> AdapterPublisher:
    settings = AdapterSyncSettings(("http://127.0.0.1:9",), "/nonexistent", max_staleness=1, prefix="p")
    return AdapterPublisher(settings, AsyncServerClient, lambda prefix, version: f"{prefix}-step-{version}")


@pytest.mark.parametrize("make", [WeightSender, _publisher, AdapterFollower, GatherFollower])
def test_every_kind_of_weight_sync_offers_what_the_trainer_calls(make):
    sync = make()  # no I/O: a sender talks to servers only from init(), a publisher from push()
    cls = type(sync)
    for name in ("push", "close"):
        _check_signature(inspect.signature(getattr(WeightSync, name)), inspect.signature(getattr(cls, name)),
                         f"{cls.__name__}.{name}")  # fmt: skip
    assert isinstance(sync, WeightSync)  # runtime_checkable: every member is there, attributes included
    assert sync.served_model is None  # nothing published yet


def test_the_publisher_serves_its_newest_adapter(tmp_path):
    publisher = _publisher()
    publisher.live.extend([("p-step-1", tmp_path / "1"), ("p-step-2", tmp_path / "2")])
    assert publisher.served_model == "p-step-2"

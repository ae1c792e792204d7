"""The server's typed seams: both engines and both weight receivers offer every member of their Protocol
(engine/api.py) with a signature a caller of the Protocol can use, the HTTP layer asks for nothing else, the
engine's commands survive the pipe, and nothing below the HTTP layer imports it.

The reference for "compatible" is the Protocol's own signature: every parameter it names is accepted by the
implementation under the same name and kind (in the same order), a parameter it leaves optional stays
optional, and whatever the implementation adds is optional.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pickle
import re
from pathlib import Path

import pytest

from asyncgrpo.server.engine import api, commands
from asyncgrpo.server.engine.engine import Engine
from asyncgrpo.server.engine.process import RemoteEngine
from asyncgrpo.server.engine.remote_receiver import RemoteReceiver
from asyncgrpo.server.engine.request import Request, RequestOutput, SamplingParams
from asyncgrpo.server.engine.settings import EngineSettings, ReceiverSettings
from asyncgrpo.server.engine.weight_receiver import WeightReceiver
from tests.unit.test_import_graph import PACKAGE_DIR, import_graph

_PROTOCOL_NOISE = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__"}


def _members(proto: type) -> dict[str, object]:
    """Name -> the Protocol's own definition (function, property, or None for a data attribute)."""
    out: dict[str, object] = {name: None for name in proto.__annotations__}
    for name, value in vars(proto).items():
        if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, property)):
            out[name] = value
    return out


def _annotated(cls: type) -> set[str]:
    return {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}


def _incompatible(want: inspect.Signature, have: inspect.Signature) -> str | None:
    """Why ``have`` cannot stand in for ``want`` (None when it can)."""
    wanted = [p for p in want.parameters.values() if p.name != "self"]
    given = {p.name: p for p in have.parameters.values() if p.name != "self"}
    var_kw = any(p.kind is p.VAR_KEYWORD for p in given.values())
    for p in wanted:
        q = given.pop(p.name, None)
        if q is None:
            if p.kind is p.KEYWORD_ONLY and var_kw:
                continue
            return f"no parameter {p.name!r}"
        if p.kind is not q.kind:
            return f"{p.name!r} is {q.kind.description}, the Protocol has it {p.kind.description}"
        if p.default is not p.empty and q.default is q.empty:
            return f"{p.name!r} is optional in the Protocol but required here"
    required = [
        q.name for q in given.values() if q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)
    ]
    if required:
        return f"extra required parameters {required}"
    positional = [p.name for p in wanted if p.kind is p.POSITIONAL_OR_KEYWORD]
    order = [p.name for p in have.parameters.values() if p.name in positional]
    return None if order == positional else f"positional order {order}, the Protocol's {positional}"


def _check(proto: type, cls: type) -> list[str]:
    problems = []
    for name, spec in _members(proto).items():
        impl = inspect.getattr_static(cls, name, None)
        if spec is None:  # a data attribute: declared on the class, or a property
            if name not in _annotated(cls) and not isinstance(impl, property):
                problems.append(f"{cls.__name__}.{name}: not declared")
        elif isinstance(spec, property):
            if not isinstance(impl, property):
                problems.append(f"{cls.__name__}.{name}: not a property")
        elif not inspect.isfunction(impl):
            problems.append(f"{cls.__name__}.{name}: missing")
        else:
            if inspect.iscoroutinefunction(spec) != inspect.iscoroutinefunction(impl):
                problems.append(f"{cls.__name__}.{name}: async in one, not in the other")
            why = _incompatible(inspect.signature(spec), inspect.signature(impl))
            if why:
                problems.append(f"{cls.__name__}.{name}: {why}")
    return problems


@pytest.mark.parametrize(
    ("proto", "cls"),
    [
        (api.EngineAPI, Engine),
        (api.EngineAPI, RemoteEngine),
        (api.ReceiverAPI, WeightReceiver),
        (api.ReceiverAPI, RemoteReceiver),
        (api.LocalEngineAPI, Engine),
    ],
    ids=lambda x: x.__name__,
)
def test_each_implementation_offers_every_protocol_member(proto, cls):
    assert not _check(proto, cls), _check(proto, cls)


def test_the_checker_catches_a_missing_member_a_wrong_kind_and_a_new_required_parameter():
    """The checker itself, against classes that break the Protocol in the ways it must catch."""

    class Proto(api.Protocol):
        size: int

        def go(self, a: int, b: int = 0, *, fast: bool = False) -> None: ...

    class Good:
        size: int

        def go(self, a, b=0, *, fast=False, extra=None): ...

    class Missing:
        def go(self, a, b=0, *, fast=False): ...

    class KeywordOnly:
        size: int

        def go(self, *, a, b=0, fast=False): ...

    class Required:
        size: int

        def go(self, a, b=0, *, fast=False, new): ...

    assert _check(Proto, Good) == []
    assert _check(Proto, Missing) == ["Missing.size: not declared"]
    assert "keyword-only" in _check(Proto, KeywordOnly)[0]
    assert "extra required" in _check(Proto, Required)[0]


def _used(path: Path, receiver: str) -> set[str]:
    """Attributes read off ``receiver`` in ``path`` (the comments' "e.g." left out)."""
    return set(re.findall(rf"(?<![\w.]){receiver}\.(\w+)", path.read_text().replace("e.g.", "")))


def test_the_http_layer_asks_the_engine_and_the_receiver_only_for_protocol_members():
    http = PACKAGE_DIR / "server" / "http"
    engine_members, receiver_members = set(_members(api.EngineAPI)), set(_members(api.ReceiverAPI))
    used = (
        _used(http / "app.py", r"state\.engine")
        | _used(http / "app.py", "e")
        | _used(http / "weight_routes.py", "engine")
    )
    assert used and used <= engine_members, used - engine_members
    used = _used(http / "weight_routes.py", "receiver")
    assert used and used <= receiver_members, used - receiver_members


def _pipe_messages() -> list[object]:
    request = Request("r1", [1, 2, 3], SamplingParams(max_tokens=4, seed=7))
    output = RequestOutput("r1", [1, 2, 3], [9, 8], [-0.5, -1.25], "length")
    error = commands.ErrorInfo("ApiError", "bad", status=400, param="update_info", api_type="BadRequestError")
    return [
        commands.Submit(request),
        commands.Abort("r1"),
        commands.RemoteCall(3, "engine", "pause", ("keep", None), {"clear_cache": False}),
        commands.Stop(),
        commands.Ready({"max_model_len": 96, "device": "cpu"}),
        commands.Failed(error),
        commands.Finished(output),
        commands.Reply(3, value=[1, 2]),
        commands.Reply(4, error=error),
        EngineSettings(device="cpu", max_model_len=96),
        ReceiverSettings(None, 60.0, "strict"),
    ]


@pytest.mark.parametrize("msg", _pipe_messages(), ids=lambda m: type(m).__name__)
def test_pipe_messages_and_settings_survive_pickling_unchanged_and_stay_frozen(msg):
    back = pickle.loads(pickle.dumps(msg))
    assert type(back) is type(msg) and back == msg
    field = dataclasses.fields(msg)[0].name if dataclasses.fields(msg) else None
    if field is not None:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, field, None)


def test_errors_cross_the_pipe_as_the_same_error():
    from asyncgrpo.server.engine.process import _portable, _rebuild
    from asyncgrpo.server.errors import ApiError

    api_err = _rebuild(pickle.loads(pickle.dumps(_portable(ApiError(409, "busy", param="init_info")))))
    assert isinstance(api_err, ApiError) and (api_err.status, api_err.message, api_err.param) == (
        409,
        "busy",
        "init_info",
    )
    assert api_err.body() == ApiError(409, "busy", param="init_info").body()
    value_err = _rebuild(_portable(ValueError("no such adapter")))
    assert type(value_err) is ValueError and str(value_err) == "no such adapter"
    other = _rebuild(_portable(ZeroDivisionError("x")))
    assert type(other) is RuntimeError and str(other) == "ZeroDivisionError: x"


def test_engine_settings_reject_unknown_fields_and_bad_check_modes():
    with pytest.raises(TypeError):
        Engine("unused", max_model_lenn=96)  # a misspelt field fails before any model is loaded
    with pytest.raises(TypeError, match="not both"):
        Engine("unused", EngineSettings(), device="cpu")
    with pytest.raises(ValueError, match="checks"):
        ReceiverSettings("gloo", 60.0, "lenient")


def test_nothing_below_the_http_layer_imports_it_or_aiohttp():
    lower = ("asyncgrpo.server.engine", "asyncgrpo.server.models", "asyncgrpo.server.layers")
    graph = import_graph()
    modules = [m for m in graph if m.startswith(lower)]
    assert len(modules) > 20  # the layers exist and were scanned
    bad = {m: sorted(t for t in graph[m] if t.startswith("asyncgrpo.server.http")) for m in modules}
    assert not {m: t for m, t in bad.items() if t}
    for module in modules:
        path = PACKAGE_DIR.parent.joinpath(*module.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n == "aiohttp" or n.startswith("aiohttp.") for n in names), module

"""The layout's rules, read from the source (docs/design.md): which folder may import which, and how long
a file may grow. Each rule names the modules that break it, so a failure says what to move."""

from __future__ import annotations

import ast
import builtins
import sys

from tests.unit.test_import_graph import PACKAGE_DIR, _module_names, import_graph

MAX_LINES = 450

# (importer prefix, forbidden target prefix, why)
FORBIDDEN = [
    ("asyncgrpo.weights", "asyncgrpo.rollout", "the weight-sync wire code stands alone: both ends use it"),
    ("asyncgrpo.weights", "asyncgrpo.client", "the sender reaches servers through weights' ServerControl Protocol"),
    ("asyncgrpo.weights", "asyncgrpo.trainer", "components never import the recipe that wires them"),
    ("asyncgrpo.server.engine", "asyncgrpo.server.http", "the engine knows nothing of HTTP"),
    ("asyncgrpo.server.models", "asyncgrpo.server.http", "the model code knows nothing of HTTP"),
    ("asyncgrpo.server.layers", "asyncgrpo.server.http", "the kernels know nothing of HTTP"),
]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks a rule, as 'importer -> target (why)'."""
    out = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            for src, dst, why in FORBIDDEN:
                if _under(module, src) and _under(target, dst):
                    out.append(f"{module} -> {target} ({why})")
            trainer_outsider = not _under(module, "asyncgrpo.trainer") and not _under(module, "asyncgrpo.cli")
            if _under(target, "asyncgrpo.trainer") and trainer_outsider:
                out.append(f"{module} -> {target} (only the CLI imports trainer/: it wires the run)")
    return out


def test_the_rules_catch_a_planted_import():
    graph = {
        "asyncgrpo.weights.sender": {"asyncgrpo.client.http_client"},
        "asyncgrpo.server.engine.loop": {"asyncgrpo.server.http.app"},
        "asyncgrpo.rollout.loop": {"asyncgrpo.trainer.trainer"},
        "asyncgrpo.cli.train": {"asyncgrpo.trainer.trainer"},
        "asyncgrpo.server.http.app": {"asyncgrpo.server.engine.loop"},
    }
    found = [f.split(" (")[0] for f in violations(graph)]
    assert found == [
        "asyncgrpo.rollout.loop -> asyncgrpo.trainer.trainer",
        "asyncgrpo.server.engine.loop -> asyncgrpo.server.http.app",
        "asyncgrpo.weights.sender -> asyncgrpo.client.http_client",
    ]


def test_no_module_breaks_a_layout_rule():
    found = violations(import_graph())
    assert not found, "imports that break the layout:\n" + "\n".join(found)


def test_the_server_layers_exist():
    for layer in ("http", "engine", "models", "layers"):
        assert (PACKAGE_DIR / "server" / layer / "__init__.py").is_file(), layer


def test_no_source_file_is_longer_than_it_can_be_read_in_one_sitting():
    long = {
        str(path.relative_to(PACKAGE_DIR)): n
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them): {long}"


def test_every_package_folder_has_an_init():
    missing = [
        str(d.relative_to(PACKAGE_DIR))
        for d in [PACKAGE_DIR, *PACKAGE_DIR.rglob("*")]
        if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").is_file()
    ]
    assert not missing, f"package folders without __init__.py: {missing}"


def test_the_graph_holds_the_imports_the_rules_allow():
    # not vacuous: the CLI imports the trainer, and the HTTP layer imports the engine
    graph = import_graph()
    assert any(_under(t, "asyncgrpo.trainer") for m, ts in graph.items() if _under(m, "asyncgrpo.cli") for t in ts)
    assert any(_under(t, "asyncgrpo.server.engine") for t in graph["asyncgrpo.server.http.app"])


# ---------------------------------------------------------------- no implementation inheritance in rollout/
# A class in rollout/ holds its collaborators; it never inherits behaviour from another class of the project
# (issue 40). A base is allowed when it resolves, through the module's own imports, to
#   * a builtin or a standard-library name (``Protocol``, ``Generic``, ``NamedTuple``, ``Enum``, an exception...),
#   * a Protocol of the project (a class whose own bases name ``Protocol``): an interface, no implementation,
#   * one of DATA_RECORDS: the wire records of ``types.py``, which the loop's records extend with a field.
# Anything else (a mixin, another rollout class, the loop, a third-party class) is a violation. The user's
# subclass of ``AsyncRolloutLoop`` lives outside rollout/ and is what the loop is for.
NO_INHERITANCE_UNDER = "asyncgrpo.rollout"
DATA_RECORDS = {
    "asyncgrpo.types.TurnRecord": "SampledTurn adds the server's finish reason to the reference's turn record",
    "asyncgrpo.types.RoutedTurn": "SampledTurn adds the server's finish reason to the turn record with MoE routing",
    "asyncgrpo.types.Rollout": "ToolLoopRollout adds the tool loop's stats to the reference's rollout record",
}


def _imported_names(tree: ast.Module, module: str) -> dict[str, str]:
    """Local name -> the dotted name it stands for (``from x import Y as Z``: Z -> x.Y; ``import x.y``: x -> x)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against the importing module's package
                base = ".".join(module.split(".")[: -node.level] + ([node.module] if node.module else []))
            for a in node.names:
                names[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.asname and a.name or a.name.split(".")[0]
    return names


def _dotted(node: ast.expr) -> str | None:
    """``a.b.C`` of a base expression (``Generic[T]`` -> ``Generic``); None for anything computed."""
    if isinstance(node, ast.Subscript):
        return _dotted(node.value)
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return head and f"{head}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else None


def _classes(sources: dict[str, str]) -> dict[str, list[str]]:
    """Every class of ``sources`` (module -> source) as its dotted name -> its bases, resolved to dotted names."""
    out: dict[str, list[str]] = {}
    for module, source in sources.items():
        tree = ast.parse(source)
        imported = _imported_names(tree, module)
        local = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = []
            for b in node.bases:
                name = _dotted(b) or "<computed>"
                head, _, rest = name.partition(".")
                if head in local:
                    name = f"{module}.{name}"
                elif head in imported:
                    name = imported[head] + (f".{rest}" if rest else "")
                bases.append(name)
            out[f"{module}.{node.name}"] = bases
    return out


def _standard(base: str) -> bool:
    """A builtin (``RuntimeError``) or a name of a standard-library module (``typing.Protocol``, ``enum.Enum``)."""
    if "." not in base:
        return hasattr(builtins, base)
    return base.split(".")[0] in sys.stdlib_module_names


def inheritance_violations(sources: dict[str, str]) -> list[str]:
    """Each class under rollout/ that inherits from a class it may not, as 'class(base)'."""
    classes = _classes(sources)
    protocols = {c for c, bases in classes.items() if any(b in ("typing.Protocol", "Protocol") for b in bases)}
    found = []
    for cls, bases in sorted(classes.items()):
        if not cls.startswith(NO_INHERITANCE_UNDER + "."):
            continue
        for base in bases:
            if not (_standard(base) or base in protocols or base in DATA_RECORDS):
                found.append(f"{cls}({base})")
    return found


def _package_sources() -> dict[str, str]:
    return {module: path.read_text() for module, path in _module_names().items()}


def test_the_inheritance_rule_catches_a_planted_mixin():
    planted = {
        "asyncgrpo.rollout.mixed": (
            "import enum, typing\n"
            "from typing import NamedTuple, Protocol, Generic, TypeVar\n"
            "from dataclasses import dataclass\n"
            "import numpy as np\n"
            "from asyncgrpo.rollout.loop import AsyncRolloutLoop\n"
            "from asyncgrpo.rollout.prompt_order import PromptSource\n"
            "from asyncgrpo.types import TurnRecord, TrainingSequence\n"
            "T = TypeVar('T')\n"
            "class Helper:\n    pass\n"
            "class Iface(Protocol):\n    def f(self) -> int: ...\n"
            "class Mixed(Helper):\n    pass\n"  # a local mixin: caught
            "class Loopish(AsyncRolloutLoop):\n    pass\n"  # the loop's implementation: caught
            "class Arr(np.ndarray):\n    pass\n"  # a third-party class: caught
            "class Seq(TrainingSequence):\n    pass\n"  # a project record not on the list: caught
            "class Source(PromptSource):\n    pass\n"  # a project Protocol: allowed
            "class Local(Iface, Generic[T]):\n    pass\n"  # a local Protocol and Generic: allowed
            "class Turn(TurnRecord):\n    pass\n"  # a listed data record: allowed
            "class Kind(enum.Enum):\n    A = 1\n"
            "class Row(NamedTuple):\n    a: int\n"
            "class Failed(RuntimeError):\n    pass\n"
            "class P2(typing.Protocol):\n    pass\n"
        ),
        "asyncgrpo.rollout.prompt_order": "from typing import Protocol\nclass PromptSource(Protocol):\n    pass\n",
        "asyncgrpo.rollout.loop": "class AsyncRolloutLoop:\n    pass\n",
        # the user's subclass of the loop, outside rollout/: not checked
        "asyncgrpo.trainer.sub": "from asyncgrpo.rollout.loop import AsyncRolloutLoop as L\nclass Mine(L): ...\n",
    }
    assert inheritance_violations(planted) == [
        "asyncgrpo.rollout.mixed.Arr(numpy.ndarray)",
        "asyncgrpo.rollout.mixed.Loopish(asyncgrpo.rollout.loop.AsyncRolloutLoop)",
        "asyncgrpo.rollout.mixed.Mixed(asyncgrpo.rollout.mixed.Helper)",
        "asyncgrpo.rollout.mixed.Seq(asyncgrpo.types.TrainingSequence)",
    ]


def test_no_class_in_rollout_inherits_implementation():
    sources = _package_sources()
    found = inheritance_violations(sources)
    assert not found, "classes in rollout/ that inherit implementation (hold the other class instead):\n" + "\n".join(
        found
    )
    # not vacuous: rollout/ has classes, and its Protocols and records are seen as such
    classes = _classes(sources)
    assert "asyncgrpo.rollout.loop.AsyncRolloutLoop" in classes
    assert classes["asyncgrpo.rollout.records.SampledTurn"] == ["asyncgrpo.types.RoutedTurn"]
    assert classes["asyncgrpo.rollout.prompt_order.PromptSource"] == ["typing.Protocol"]

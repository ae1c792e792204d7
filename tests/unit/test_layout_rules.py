"""The layout's rules, read from the source (docs/design.md): which folder may import which, and how long
a file may grow. Each rule names the modules that break it, so a failure says what to move."""

from __future__ import annotations

from tests.unit.test_import_graph import PACKAGE_DIR, import_graph

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

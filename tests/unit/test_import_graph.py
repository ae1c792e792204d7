"""No file-level import cycle among ``asyncgrpo`` modules (issue 7).

Every ``import``/``from ... import`` statement counts, wherever it stands: at the top, under
``if TYPE_CHECKING:`` or inside a function. A cycle means two files cannot be read (or
moved) one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import asyncgrpo

PACKAGE_DIR = Path(asyncgrpo.__file__).parent
ROOT = PACKAGE_DIR.name  # "asyncgrpo"


def _module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name an ``ImportFrom`` names (relative imports resolved against ``module``)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``asyncgrpo`` modules it imports."""
    modules = _module_names()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, path, node)
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                if target in modules and target != module and (target == ROOT or target.startswith(ROOT + ".")):
                    graph[module].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None (iterative three-colour DFS)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_cycle_finder_finds_a_known_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    # A top-level absolute import, a function-local one (cli.py imports its subcommands lazily), and a
    # package __init__ re-exporting its submodules.
    assert "asyncgrpo.rollout.admission" in graph["asyncgrpo.rollout.production"]
    assert "asyncgrpo.server.main" in graph["asyncgrpo.cli"]
    assert "asyncgrpo.packing.row" in graph["asyncgrpo.packing"]
    assert len(graph) >= 50  # every module of the package was parsed


def test_no_import_cycle_between_asyncgrpo_modules():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])

"""Nothing outside ``trainer/`` imports ``trainer/`` but the command line (issue 27, second round, item 6).

The trainer is the top of the import graph: the server, the worker, the assets and the tasks must load without it
(and without what it pulls in), so a helper they share lives in a neutral module (e.g. ``asyncgrpo.files``).
"""

from __future__ import annotations

from tests.unit.test_import_graph import import_graph


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_only_the_trainer_and_the_cli_import_the_trainer():
    graph = import_graph()
    offenders = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if not (_inside(module, "asyncgrpo.trainer") or _inside(module, "asyncgrpo.cli"))
        for target in targets
        if _inside(target, "asyncgrpo.trainer")
    )
    assert offenders == []


def test_the_rule_sees_an_import_of_the_trainer():
    # the check is not vacuous: the CLI does import the trainer, and the graph shows it
    graph = import_graph()
    assert any(_inside(t, "asyncgrpo.trainer") for m, ts in graph.items() if _inside(m, "asyncgrpo.cli") for t in ts)

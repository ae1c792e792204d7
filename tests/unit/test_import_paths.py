"""The declared import paths (issue 34): the public modules docs/usage.md lists, the old paths that keep working
with one warning naming the new one, and a YAML reward path that does not import naming the closest one."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml

import asyncgrpo
from asyncgrpo.cli import main
from asyncgrpo.import_paths import MOVED, PUBLIC_MODULES

ROOT = Path(__file__).resolve().parents[2]


def usage_tables() -> list[list[tuple[str, str]]]:
    """The tables of docs/usage.md's "Public API" section as (first cell, second cell) rows."""
    text = (ROOT / "docs" / "usage.md").read_text()
    section = text.split("## Public API", 1)[1].split("\n## ", 1)[0]
    tables, rows = [], []
    for line in section.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not set(cells[0]) <= set("-") and cells[0] not in ("module", "old path"):
                rows.append((cells[0].strip("`"), cells[1]))
        elif rows:
            tables.append(rows)
            rows = []
    return tables


def test_usage_md_lists_every_public_module_and_every_moved_path():
    public, moved = usage_tables()
    assert [m for m, _ in public] == list(PUBLIC_MODULES)
    assert {old: new.strip("`") for old, new in moved} == MOVED


def test_the_public_names_resolve():
    for name in asyncgrpo.__all__:
        assert getattr(asyncgrpo, name) is not None, name
    import importlib

    for module, what in PUBLIC_MODULES.items():
        mod = importlib.import_module(module)
        named = [n for n in re.findall(r"\b[A-Za-z_]\w*\b", what) if n in getattr(mod, "__all__", ())]
        for name in named:  # every name the table promises and the module exports is there
            assert hasattr(mod, name), f"{module}.{name}"


OLD_PATHS = """
import importlib, json, logging, sys, warnings
from asyncgrpo.import_paths import MOVED
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for old, new in sorted(MOVED.items()):
        alias, target = importlib.import_module(old), importlib.import_module(new)
        name = sorted(getattr(target, "__all__", None) or [n for n in vars(target) if not n.startswith("_")])[0]
        first, second = getattr(alias, name), getattr(alias, name)  # the second use says nothing
        out[old] = [name, first is getattr(target, name) and second is first]
print(json.dumps({"same": out, "warnings": [str(w.message) for w in caught if w.category is DeprecationWarning]}))
"""


def test_every_moved_path_is_its_new_module_and_says_so_once():
    done = subprocess.run([sys.executable, "-c", OLD_PATHS], capture_output=True, text=True, timeout=120,
                          check=False, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(same for _, same in got["same"].values()), got["same"]
    lines = [line for line in done.stderr.splitlines() if " moved to " in line]
    expected = {f"{old} moved to {new}" for old, new in MOVED.items()}
    assert len(lines) == len(MOVED) and {line.split(": ", 1)[1].split(";")[0] for line in lines} == expected, lines
    assert sorted(w.split(";")[0] for w in got["warnings"]) == sorted(expected)


def test_python_m_of_an_old_module_runs_the_new_one():
    done = subprocess.run([sys.executable, "-m", "asyncgrpo.docs", "--help"], capture_output=True, text=True,
                          timeout=120, check=False, cwd=ROOT)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Regenerate the generated sections of the docs" in done.stdout
    said = "asyncgrpo.docs moved to asyncgrpo.cli.docs; the old path still works but will be removed: import "
    assert [line for line in done.stderr.splitlines() if "moved to" in line] == [said + "asyncgrpo.cli.docs instead"]


def _train_with_reward(tmp_path: Path, reward: str, capsys) -> str:
    cfg = yaml.safe_load((ROOT / "examples" / "demo.yaml").read_text())
    cfg["reward_funcs"] = [reward]
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 1, err
    return err


def test_a_misspelled_module_exits_2_naming_the_closest_path(tmp_path, capsys):
    err = _train_with_reward(tmp_path, "asyncgrpo.taks.reasoning:numeric_answer_reward", capsys)
    assert "no module named 'asyncgrpo.taks' (did you mean 'asyncgrpo.tasks.reasoning:numeric_answer_reward'?)" in err
    err = _train_with_reward(tmp_path, "asyncgrpo.recipes.taks:numeric_answr_reward", capsys)  # old and misspelled
    assert "(did you mean 'asyncgrpo.tasks.reasoning:numeric_answer_reward'?)" in err


def test_a_misspelled_function_exits_2_naming_the_closest_path(tmp_path, capsys):
    err = _train_with_reward(tmp_path, "asyncgrpo.tasks.reasoning:numeric_answer_rewrd", capsys)
    assert "has no 'numeric_answer_rewrd' (did you mean 'asyncgrpo.tasks.reasoning:numeric_answer_reward'?)" in err


def test_an_unknown_package_is_not_matched_to_ours(tmp_path, capsys):
    err = _train_with_reward(tmp_path, "my_rewards.math:score", capsys)
    assert "no module named 'my_rewards'" in err and "did you mean" not in err

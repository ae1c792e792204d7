"""The docs' generated sections match the code (regenerate with `python -m asyncgrpo.cli.docs`).

``docs/config.md`` holds the configuration reference and ``docs/metrics.md`` the metrics glossary; the README
links to both (``tests/unit/test_docs_resolve.py`` checks the links).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from asyncgrpo.cli import docs
from asyncgrpo.cli.run_config import LOAD_KEYS, RECIPE_KEYS, SERVER_KEYS, TOP_KEYS
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.metrics import METRICS

ROOT = Path(__file__).resolve().parents[2]
GENERATED = [(path, section) for path, sections in docs.DOC_FILES.items() for section in sections]


def test_every_section_has_a_docs_file():
    assert sorted(s for _, s in GENERATED) == sorted(docs.SECTIONS)


@pytest.mark.parametrize(("path", "section"), GENERATED)
def test_generated_section_is_current(path, section):
    text = (ROOT / path).read_text()
    assert docs.section_in(text, section) == docs.generated(section), (
        f"{path}: section {section} is stale: run `python -m asyncgrpo.cli.docs` from the repository root"
    )


def test_the_command_rewrites_a_stale_file_and_check_reports_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    for path, sections in docs.DOC_FILES.items():
        marks = "".join(f"<!-- BEGIN {s} (generated) -->\nold\n<!-- END {s} -->\n" for s in sections)
        (tmp_path / path).write_text("# title\n\n" + marks + "tail\n")
    assert docs.main(["--check"]) == 1
    assert "stale: docs/config.md, docs/metrics.md" in capsys.readouterr().err
    assert docs.main([]) == 0 and docs.main(["--check"]) == 0
    for path, sections in docs.DOC_FILES.items():
        text = (tmp_path / path).read_text()
        assert text.startswith("# title\n\n") and text.endswith("tail\n")
        assert all(docs.section_in(text, s) == docs.generated(s) for s in sections)


def test_reference_covers_every_own_field_with_its_help():
    table = docs.config_reference()
    fields = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    for name in AsyncGRPOConfig.__annotations__:
        row = next(line for line in table.splitlines() if line.startswith(f"| `{name}` |"))
        first_words = " ".join(fields[name].metadata["help"].split()[:4])
        assert first_words in row, name


def test_glossary_covers_every_metric():
    table = docs.metrics_glossary()
    for name in METRICS:
        assert f"| `{name}` |" in table
    assert (
        "| `perf/step_s` | wall time of a step, optimizer, weight sync and sample wait included | mean | s |" in table
    )
    assert "| `rollout/vllm_retry_count` |" in table and "retried | sum |" in table


def test_yaml_keys_are_documented():
    section = (ROOT / "docs" / "config.md").read_text().split("## The YAML file", 1)[1].split("\n## ", 1)[0]
    for key in (*TOP_KEYS, *SERVER_KEYS, *RECIPE_KEYS, *LOAD_KEYS):
        assert f"`{key}" in section, key

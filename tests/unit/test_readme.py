"""The README's generated sections match the code (regenerate with `python -m asyncgrpo.docs README.md`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from asyncgrpo import docs
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.metrics import METRICS
from asyncgrpo.run_config import LOAD_KEYS, RECIPE_KEYS, SERVER_KEYS, TOP_KEYS

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


@pytest.mark.parametrize("section", docs.SECTIONS)
def test_generated_section_is_current(section):
    assert docs.section_in(README, section) == docs.generated(section), (
        f"README section {section} is stale: run `python -m asyncgrpo.docs README.md`"
    )


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
    section = README.split("## Configuration reference", 1)[1].split("## Metrics glossary", 1)[0]
    for key in (*TOP_KEYS, *SERVER_KEYS, *RECIPE_KEYS, *LOAD_KEYS):
        assert f"`{key}" in section, key

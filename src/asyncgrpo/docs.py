"""The README's generated sections: the configuration reference (from AsyncGRPOConfig's help texts) and the
metrics glossary (from ``METRICS``), so the docs cannot drift from the code.

    python -m asyncgrpo.docs README.md     # rewrite the sections between their BEGIN/END markers

``tests/unit/test_readme.py`` fails when the README's copy differs from what this module generates.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

SECTIONS = ("config-reference", "metrics-glossary")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _type_text(tp: object) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "")


def config_reference() -> str:
    """A table of every field AsyncGRPOConfig defines or re-defaults (TrainingArguments' own are linked)."""
    from asyncgrpo.config import AsyncGRPOConfig

    own = list(AsyncGRPOConfig.__annotations__)
    fields = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name in own:
        f = fields[name]
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)"
        tp = _type_text(AsyncGRPOConfig.__annotations__[name])  # the source text: HfArgumentParser rewrites f.type
        lines.append(f"| `{name}` | `{_cell(tp)}` | `{default!r}` | {_cell(f.metadata.get('help', ''))} |")
    return "\n".join(lines)


def metrics_glossary() -> str:
    """A table of every metric name with its meaning and its window rule (M2)."""
    from asyncgrpo.evaluate import EVAL_METRICS
    from asyncgrpo.metrics import METRICS, SERVER_METRICS, aggregation_rule, unit_of

    rule_text = {"sum": "sum", "max": "max", "min": "min", "mean": "mean"}
    lines = ["| metric | meaning | window | unit |", "|---|---|---|---|"]
    for name, meaning in {**METRICS, **SERVER_METRICS, **EVAL_METRICS}.items():
        unit = unit_of(name) or ""
        lines.append(f"| `{name}` | {_cell(meaning)} | {rule_text[aggregation_rule(name)]} | {unit} |")
    return "\n".join(lines)


def generated(section: str) -> str:
    return {"config-reference": config_reference, "metrics-glossary": metrics_glossary}[section]()


def _pattern(section: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN {section}[^>]*-->\n)(.*?)(<!-- END {section} -->)", re.DOTALL)


def section_in(text: str, section: str) -> str | None:
    """The README's current copy of a generated section, or None without its markers."""
    m = _pattern(section).search(text)
    return m.group(2).removesuffix("\n") if m else None


def rewrite(text: str) -> str:
    for section in SECTIONS:
        if section_in(text, section) is None:
            raise ValueError(f"the README lacks the markers <!-- BEGIN {section} --> ... <!-- END {section} -->")
        text = _pattern(section).sub(lambda m, s=section: m.group(1) + generated(s) + "\n" + m.group(3), text)
    return text


if __name__ == "__main__":
    readme = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    readme.write_text(rewrite(readme.read_text()))

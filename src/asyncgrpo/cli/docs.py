"""The generated parts of the docs: the configuration reference (from AsyncGRPOConfig's help texts) in
``docs/config.md`` and the metrics glossary (from ``METRICS``) in ``docs/metrics.md``, so they cannot drift
from the code.

    python -m asyncgrpo.cli.docs                  # from the repository root: rewrite both files' generated sections
    python -m asyncgrpo.cli.docs --check          # exit 1, naming the stale files, instead of writing
    python -m asyncgrpo.cli.docs docs/config.md   # only the files named

Each file keeps its hand-written text; only what lies between a section's BEGIN/END markers is replaced.
``tests/unit/test_readme.py`` fails when a file's copy differs from what this module generates.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

SECTIONS = ("config-reference", "metrics-glossary")
# Which generated sections each docs file holds (paths relative to the repository root).
DOC_FILES = {"docs/config.md": ("config-reference",), "docs/metrics.md": ("metrics-glossary",)}
COMMAND = "python -m asyncgrpo.cli.docs"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _type_text(tp: object) -> str:
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", str(tp))
    return text.replace("typing.", "")


def config_reference() -> str:
    """A table of every field AsyncGRPOConfig defines or re-defaults (TrainingArguments' own are linked)."""
    from transformers import TrainingArguments

    from asyncgrpo.config import AsyncGRPOConfig

    # Its own fields, then those of its field mixins (config_<topic>.py), each with the source text of its type.
    mixins = [
        c for c in AsyncGRPOConfig.__mro__ if "__annotations__" in vars(c) and not issubclass(TrainingArguments, c)
    ]
    annotations = {name: tp for c in reversed(mixins) for name, tp in vars(c)["__annotations__"].items()}
    own = [name for c in mixins for name in vars(c)["__annotations__"]]
    fields = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    lines = ["| field | type | default | meaning |", "|---|---|---|---|"]
    for name in own:
        f = fields[name]
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)"
        tp = _type_text(annotations[name])  # the source text: HfArgumentParser rewrites f.type
        lines.append(f"| `{name}` | `{_cell(tp)}` | `{default!r}` | {_cell(f.metadata.get('help', ''))} |")
    return "\n".join(lines)


def metrics_glossary() -> str:
    """A table of every metric name with its meaning and its window rule (M2)."""
    from asyncgrpo.metrics import METRICS, SERVER_METRICS, STARTUP_METRICS, aggregation_rule, unit_of
    from asyncgrpo.rollout.dynamic_sampling import DYNAMIC_SAMPLING_METRICS
    from asyncgrpo.rollout.prompt_pools import POOL_METRICS
    from asyncgrpo.tasks.evaluate import EVAL_METRICS

    rule_text = {"sum": "sum", "max": "max", "min": "min", "mean": "mean"}
    lines = ["| metric | meaning | window | unit |", "|---|---|---|---|"]
    for name, meaning in {
        **METRICS,
        **STARTUP_METRICS,
        **SERVER_METRICS,
        **EVAL_METRICS,
        **DYNAMIC_SAMPLING_METRICS,
        **POOL_METRICS,
    }.items():
        unit = unit_of(name) or ""
        lines.append(f"| `{name}` | {_cell(meaning)} | {rule_text[aggregation_rule(name)]} | {unit} |")
    return "\n".join(lines)


def generated(section: str) -> str:
    return {"config-reference": config_reference, "metrics-glossary": metrics_glossary}[section]()


def _pattern(section: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- BEGIN {section}[^>]*-->\n)(.*?)(<!-- END {section} -->)", re.DOTALL)


def section_in(text: str, section: str) -> str | None:
    """A file's current copy of a generated section, or None without its markers."""
    m = _pattern(section).search(text)
    return m.group(2).removesuffix("\n") if m else None


def rewrite(text: str, sections: tuple[str, ...] = SECTIONS) -> str:
    """``text`` with every section of ``sections`` regenerated; each must have its markers."""
    for section in sections:
        if section_in(text, section) is None:
            raise ValueError(f"missing the markers <!-- BEGIN {section} --> ... <!-- END {section} -->")
        text = _pattern(section).sub(lambda m, s=section: m.group(1) + generated(s) + "\n" + m.group(3), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="Regenerate the generated sections of the docs.")
    parser.add_argument("files", nargs="*", help=f"docs files to rewrite (default: {', '.join(DOC_FILES)})")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = parser.parse_args(argv)
    stale = []
    for name in args.files or list(DOC_FILES):
        path = Path(name)
        key = next((k for k in DOC_FILES if path.as_posix().endswith(k)), None)
        if key is None:
            parser.error(f"{name} is not a generated docs file; known: {', '.join(DOC_FILES)}")
        if not path.is_file():
            parser.error(f"{path} not found: run from the repository root or name the file")
        text = path.read_text()
        try:
            new = rewrite(text, DOC_FILES[key])
        except ValueError as exc:
            parser.error(f"{path}: {exc}")
        if new != text:
            stale.append(str(path))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; run `{COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

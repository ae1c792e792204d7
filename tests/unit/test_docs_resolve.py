"""Everything the code cites resolves inside the repository (issue 27, item 1).

- every requirement tag (G3, X5, ...) cited in a comment, docstring or message under ``src/``, ``tests/`` or
  ``bench/`` has a row in ``docs/spec.md``, and every benchmark id (B4, B5-HTTP, ...) one in ``docs/benchmarks.md``;
- every test ``docs/spec.md`` names as covering a requirement exists;
- every ``.md`` file the code, the Makefile, CI or the examples cite exists;
- the README stays a short map: at most ``README_MAX_LINES`` lines, its two commands first, every docs page linked,
  and every relative link of the README and of ``docs/`` (file and ``#anchor``) resolves.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README_MAX_LINES = 260
CODE_DIRS = ("src", "tests", "bench")

# Requirement tags as docs/spec.md spells them: a group letter and a number (G1..G13, X9, ...). "L2-norm" is the L2
# norm, not the loss requirement L2. Benchmark ids: B1..B8 with an optional suffix (B4-IPC, B5-HTTP, B6-1GPU).
TAG = re.compile(r"(?<![\w/.])([GRLPTAMX]\d{1,2})(?![\w])(?!-norm)")  # the second end of "A1-A4" too
BENCH = re.compile(r"(?<![\w/.-])(B\d{1,2}(?:-(?:IPC|HTTP|1GPU))?)(?![\w])")
ROW_ID = re.compile(r"^\| ([A-Z]\d{1,2}(?:-[A-Z0-9]+)?) \|", re.MULTILINE)
MD_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.md)(?![\w])")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _code_files() -> list[Path]:
    files = [p for d in CODE_DIRS for p in (ROOT / d).rglob("*") if p.suffix in (".py", ".sh") and p.is_file()]
    return sorted(p for p in files if "results" not in p.relative_to(ROOT).parts)


def _prose(source: str, python: bool = True) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and every string with a space in it (docstrings, messages).

    Strings without whitespace are names, not citations: ``("L4", 121e12)`` in ``metrics.py`` is a GPU.
    """
    if not python:
        return [(i, line) for i, line in enumerate(source.splitlines(), 1) if line.lstrip().startswith("#")]
    strings = {tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}  # f-string text on 3.12+
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type in strings and re.search(r"\s", tok.string)):
            out.append((tok.start[0], tok.string))
    return out


@cache
def _file_prose(path: Path) -> tuple[tuple[int, str], ...]:
    return tuple(_prose(path.read_text(), python=path.suffix == ".py"))


@cache
def _defined(path: Path) -> frozenset[str]:
    """Names of the functions ``path`` defines (test functions and methods)."""
    tree = ast.parse(path.read_text())
    return frozenset(n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


@cache
def _cited() -> dict[str, list[str]]:
    """Every tag or benchmark id cited in the code -> where (``path:line``)."""
    cited: dict[str, list[str]] = {}
    for path in _code_files():
        for line, text in _file_prose(path):
            for tag in TAG.findall(text) + BENCH.findall(text):
                cited.setdefault(tag, []).append(f"{path.relative_to(ROOT)}:{line}")
    return cited


def _rows(page: str) -> set[str]:
    return set(ROW_ID.findall((DOCS / page).read_text()))


def test_every_cited_tag_has_a_row_in_spec_or_benchmarks():
    cited = _cited()
    assert sum(map(len, cited.values())) > 100, "the tag scan found almost nothing: is the pattern still right?"
    known = _rows("spec.md") | _rows("benchmarks.md")
    missing = {tag: where[:3] for tag, where in sorted(cited.items()) if tag not in known}
    assert not missing, f"tags cited in the code but not in docs/spec.md or docs/benchmarks.md: {missing}"


def test_the_scan_skips_names_and_the_l2_norm():
    gpus = 'GPUS = [("L4", 1.0), ("A' + '10", 2.0)]'  # split: this file is scanned too, and that GPU is no tag
    sample = f"# L2-normalise q and k; see G3 and B5-HTTP (A1-A4)\n{gpus}\nx = 'X5 in a message'\n"
    found = [tag for _, text in _prose(sample) for tag in TAG.findall(text) + BENCH.findall(text)]
    assert found == ["G3", "A1", "A4", "B5-HTTP", "X5"]


def test_spec_has_one_row_per_requirement_and_benchmarks_one_per_id():
    spec = (DOCS / "spec.md").read_text()
    tags = ROW_ID.findall(spec)
    assert len(tags) == len(set(tags)), "a tag has two rows in docs/spec.md"
    groups = {"G": 13, "R": 6, "L": 6, "P": 6, "T": 9, "A": 5, "M": 4, "X": 9}
    assert set(tags) == {f"{g}{i}" for g, n in groups.items() for i in range(1, n + 1)}
    bench = ROW_ID.findall((DOCS / "benchmarks.md").read_text())
    ids = {"B1", "B2", "B3", "B4", "B4-IPC", "B5", "B5-HTTP", "B6", "B6-1GPU", "B7", "B8", "B9"}  # B9: issue 41
    assert set(bench) == ids and len(bench) == 2 * len(ids)  # one row in Targets, one in Measured


def test_every_test_named_in_spec_exists():
    missing = []
    for ref in sorted(set(re.findall(r"tests/[\w/]+\.(?:py|sh)(?:::\w+)?", (DOCS / "spec.md").read_text()))):
        file, _, name = ref.partition("::")
        path = ROOT / file
        if not path.is_file() or (name and name not in _defined(path)):
            missing.append(ref)
    assert not missing, f"docs/spec.md names tests that do not exist: {missing}"


def test_every_cited_md_file_exists():
    """Comments, docstrings and messages of the code; every line of the Makefile, CI and the examples."""
    texts = [(p, _file_prose(p)) for p in _code_files()]
    for path in [ROOT / "Makefile", ROOT / ".ci" / "run", *(ROOT / "examples").iterdir()]:
        texts.append((path, list(enumerate(path.read_text().splitlines(), 1))))
    missing = [
        f"{path.relative_to(ROOT)}:{line}: {cited}"
        for path, prose in texts
        for line, text in prose
        for cited in MD_PATH.findall(text)
        if not (ROOT / cited).is_file()
    ]
    assert not missing, "cited .md files the repository does not hold (cite them from its root):\n" + "\n".join(missing)


def test_readme_is_a_short_map_with_its_two_commands_first():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    first_block = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1)
    assert [line.split("#")[0].strip() for line in first_block.splitlines()] == ["make demo", "make test"]
    linked = {target.split("#")[0] for target in LINK.findall(readme)}
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens (code blocks skipped)."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", text, re.MULTILINE)
    }


@pytest.mark.parametrize("page", ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))])
def test_relative_links_resolve(page):
    source = ROOT / page
    broken = []
    for target in LINK.findall(source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = (source.parent / file).resolve() if file else source
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, f"{page}: links that do not resolve: {broken}"

"""The README's Train section as the install lane runs it: ``serve-flags`` prints the serve command's flags (one a
line) without its port; ``script OUT PORT STEPS`` writes the Python script to OUT with the server's port and
the number of steps changed, and nothing else (each change must find its text exactly once).

Reads README.md as text and imports nothing of asyncgrpo (the lane runs the installed wheel, not this checkout).
The same extraction as tests/integration/test_readme_snippets.py.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def train_section() -> str:
    return README.split("\n## Train\n", 1)[1].split("\n## ", 1)[0]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.DOTALL)


def replace_once(code: str, old: str, new: str) -> str:
    if code.count(old) != 1:
        raise SystemExit(f"the README's Train script no longer contains {old!r} exactly once: update the lane")
    return code.replace(old, new)


def serve_flags() -> list[str]:
    line = next(ln for b in blocks(train_section(), "bash") for ln in b.splitlines() if "asyncgrpo serve" in ln)
    argv = shlex.split(line)
    if argv[:3] != ["asyncgrpo", "serve", "demo"] or "--port" not in argv:
        raise SystemExit(f"the README's serve command changed: {line!r}; update the lane")
    flags = argv[3:]
    i = flags.index("--port")
    del flags[i : i + 2]
    return flags


def script(port: int, steps: int) -> str:
    (code,) = [b for b in blocks(train_section(), "python") if "AsyncGRPOTrainer(" in b]
    code = replace_once(code, '"http://localhost:8000"', f'"http://localhost:{port}"')
    return replace_once(code, "max_steps=8", f"max_steps={steps}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-flags"]:
        print("\n".join(serve_flags()))
    elif sys.argv[1:2] == ["script"] and len(sys.argv) == 5:
        Path(sys.argv[2]).write_text(script(int(sys.argv[3]), int(sys.argv[4])))
    else:
        raise SystemExit(__doc__)

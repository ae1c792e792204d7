"""The command line imports no torch before a command needs it: ``asyncgrpo serve`` spawns its engine process
first and loads its tokenizer beside it (issue 41); a report-side import of torch cost the server's start 1.5-3 s."""

import subprocess
import sys

CHECK = """
import sys
from asyncgrpo.cli import _build_parser
from asyncgrpo.server.main import run_serve  # what serve runs before it spawns the engine
from asyncgrpo.server.engine.process import RemoteEngine
_build_parser().parse_args(["serve", "some/model", "--device", "cuda"])
print(sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules))
"""


def test_building_the_parser_and_starting_serve_import_no_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]

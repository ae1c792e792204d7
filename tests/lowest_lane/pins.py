"""The lowest-versions lane's pins, read from pyproject.toml: every `name>=X` requirement becomes `name==X`.

    python tests/lowest_lane/pins.py [--torch torch==2.13.0]   # one pin a line, for `pip install -c`

Reading the bounds from pyproject.toml (not a hand-kept list) keeps the lane honest: raising or lowering a declared
bound changes what the lane installs. Two exceptions, each printed as a comment in the output:
- torch: the declared floor (2.11) is tested by the GPU suite (the GPU machine runs torch 2.11); on the CPU
  machines PyPI's torch 2.11 is a multi-GB CUDA build, so the lane takes the CPU build these machines keep on disk.
- requirements without a lower bound (numpy) are left to pip's resolver: their lowest release is not a claim.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The extras whose requirements the lane's tests need (dev only adds ruff, which the lane does not run).
EXTRAS = ("test",)
_REQ = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*>=\s*([0-9][0-9A-Za-z.]*)\s*(?:;(.*))?$")


def lowest_pins(pyproject: dict, torch_pin: str) -> list[str]:
    """`name==lowest` for every lower-bounded requirement (runtime and EXTRAS), torch replaced by torch_pin."""
    project = pyproject["project"]
    reqs = list(project["dependencies"])
    for extra in EXTRAS:
        reqs += [r for r in project["optional-dependencies"][extra] if not r.startswith("asyncgrpo")]
    pins: dict[str, str] = {}
    for req in reqs:
        m = _REQ.match(req.split("#")[0])
        if m is None:
            continue  # no lower bound: pip picks
        name, version, marker = m.group(1).lower(), m.group(2), m.group(3)
        pin = f"{name}=={version}" + (f"; {marker.strip()}" if marker else "")
        pins[name] = torch_pin if name == "torch" else pin
    return [pins[name] for name in sorted(pins)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", default="torch==2.13.0", help="the torch pin (the CPU build on this disk)")
    args = parser.parse_args(argv)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    print(f"# from {ROOT / 'pyproject.toml'}; torch: {args.torch} (the declared floor is tested by the GPU suite)")
    print("\n".join(lowest_pins(pyproject, args.torch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

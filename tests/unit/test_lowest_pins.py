"""The lowest-versions lane pins exactly the lower bounds pyproject.toml declares (tests/lowest_lane/pins.py).

The reference is packaging's own reading of each requirement (PEP 508), not the lane's regular expression.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.requirements import Requirement

from tests.lowest_lane.pins import EXTRAS, lowest_pins

ROOT = Path(__file__).resolve().parents[2]


def test_every_lower_bound_is_pinned_and_nothing_else():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = {Requirement(p).name: Requirement(p) for p in lowest_pins(pyproject, "torch==2.13.0")}
    project = pyproject["project"]
    declared = [Requirement(r) for r in project["dependencies"]]
    declared += [Requirement(r) for e in EXTRAS for r in project["optional-dependencies"][e]]
    bounded = {}
    for req in declared:
        floors = [s.version for s in req.specifier if s.operator == ">="]
        if req.name != "asyncgrpo" and floors:
            bounded[req.name.lower()] = (floors[0], req.marker)
    assert set(pins) == set(bounded)  # numpy (no bound) is left to pip
    for name, (floor, marker) in bounded.items():
        (spec,) = pins[name].specifier
        assert spec.operator == "=="
        assert spec.version == ("2.13.0" if name == "torch" else floor), name
        assert str(pins[name].marker) == str(marker) if marker else pins[name].marker is None

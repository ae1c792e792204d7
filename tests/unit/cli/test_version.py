"""``asyncgrpo --version``: this package's version with Python's, torch's and transformers', as installed."""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from importlib import metadata

import asyncgrpo


def test_version_names_what_is_installed():
    done = subprocess.run([sys.executable, "-m", "asyncgrpo", "--version"], capture_output=True, text=True,
                          timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    deps = f"torch {metadata.version('torch')}, transformers {metadata.version('transformers')}"
    assert done.stdout.strip() == f"asyncgrpo {asyncgrpo.__version__} (python {platform.python_version()}, {deps})"


def test_the_package_version_is_the_installed_metadata():
    """pyproject.toml reads the version from ``asyncgrpo.__version__`` (one place), a PEP 440 release."""
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", asyncgrpo.__version__)
    assert metadata.version("asyncgrpo") == asyncgrpo.__version__

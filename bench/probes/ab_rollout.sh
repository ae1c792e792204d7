#!/usr/bin/env bash
# A/B of the rollout path between two source trees, alternating in one call on one machine, so that a slower host
# (a different machine, a busier CPU) moves both sides alike. The bench itself is this tree's; only src/ differs.
#   here:  mkdir -p .ab_base && git archive BASE_COMMIT src | tar -x -C .ab_base     (carry .ab_base; git-ignored)
#   there: bash bench/probes/ab_rollout.sh .ab_base [ROUNDS] [SHAPES]
# AB_ARGS adds bench flags (AB_ARGS=--tiny: a CPU smoke run; PY picks the interpreter). Writes $OUT/ab_base_N.json and $OUT/ab_head_N.json (N = round) and prints each run's ratios.
set -uo pipefail
BASE=${1:?the baseline tree (holding src/)}; ROUNDS=${2:-2}; SHAPES=${3:-b5,grpo_n}
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
for round in $(seq 1 "$ROUNDS"); do
  for side in base head; do
    src=$PWD/src; [ "$side" = base ] && src=$(cd "$BASE" && pwd)/src
    echo "=== round $round: $side ($src) $(date +%T)"
    PYTHONPATH=/tmp/site:$src timeout 280 ${PY:-python3} bench/rollout_path.py --shapes "$SHAPES" \
      --variants in_process,http,worker --repeats 2 --max-seconds 260 ${AB_ARGS:-} --out "$OUT/ab_${side}_${round}.json" \
      > "$OUT/ab_${side}_${round}.log" 2>&1 || echo "  failed: see ab_${side}_${round}.log"
    grep -E "^ratios|^-- " "$OUT/ab_${side}_${round}.log"
  done
done

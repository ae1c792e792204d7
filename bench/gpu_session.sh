#!/usr/bin/env bash
# Run GPU stages on the lent GPU machine; everything lands in $OUT (or ./gpu-out).
#   bash bench/gpu_session.sh tests generation     # one H200 is enough (the weight-sync tests need two)
#   bash bench/gpu_session.sh model-a              # first half of the demo GGUF (see ../shared/tools/device-model-parts)
#   bash bench/gpu_session.sh model-b train packing
#   bash bench/gpu_session.sh model-b agent        # issue 8: calculator agent, warm-up + RL, before/after (one H200)
#   bash bench/gpu_session.sh model-b fsdp         # issue 12: two-rank FSDP2 run + one-rank run (two H200)
#   bash bench/gpu_session.sh weightsync           # issue 12 B4: weight sync vs bare NCCL, breakdown, FSDP2 (two H200)
#   bash bench/gpu_session.sh deltanet             # issue 11: Gated DeltaNet hybrids in the trie (one H200)
#   BASELINE_SRC=.baseline/src bash bench/gpu_session.sh ipc  # issue 38 B4-IPC, today's main as the baseline
#   bash bench/gpu_session.sh enginegc             # GC pauses inside the engine at B5's shape (one H200, ~1 min)
#   bash bench/gpu_session.sh rollout              # issue 10 B5-HTTP: in process / HTTP / worker, both shapes (one H200)
#   bash bench/gpu_session.sh rollout-long         # the same x4 (streaming through the worker, as in training; one H200)
#   bash bench/gpu_session.sh learning             # issue 10 B6/B8: async vs sync, held-out accuracy (two H200, ~8 min)
#   bash bench/gpu_session.sh learning-b6          # issue 10 B6 with heavier training steps (checkpointing on; two H200)
#   BASELINE_SRC=.baseline/src bash bench/gpu_session.sh ttl   # issue 41: time to learning, main then this checkout
#   bash bench/gpu_session.sh ssp                  # issue 41: the small packed step alone, per variant
#   TTL_RUNS=async_cold,async_warm,sync_warm,async_warm_mps TTL_BASELINE_RUNS=async_cold,async_warm \
#     BASELINE_SRC=.baseline/src TTL_TIMEOUT=430 bash bench/gpu_session.sh ttl   # issue 41's final call (6 runs: ~6.5 min)
#   TESTS_TIMEOUT=380 PACKING_SECONDS=120 bash bench/gpu_session.sh tests packing  # then the GPU suite, B1/B2 (same commit)
#   BASELINE_SRC=.baseline/src PACKING_SECONDS=100 bash bench/gpu_session.sh packing-ab  # B1/B2 compiled, main vs this
#   (the graphs stage alone needs more than 140 s: its first three tests took that long on 2026-12-04)
#   PACKING_SECONDS=150 bash bench/gpu_session.sh profile37  # issue 37's profile call: B5 + B1/B2 (1.7B) with tables
#   BASELINE_SRC=.baseline/src PACKING_SECONDS=100 GPU_TESTS="tests/gpu/test_engine_gpu.py ..." bash bench/gpu_session.sh issue37
#     # issue 37's change call: B5 main vs this checkout (profiled), B1/B2 profiled, the named GPU tests, one archive
#   BASELINE_SRC=.baseline/src bash bench/gpu_session.sh issue37s2  # issue 37, second session: B1/B2 this vs main, tests
#   BASELINE_SRC=.baseline37/src bash bench/gpu_session.sh issue37s2b  # the same after the head kernels, profiled
#   BASELINE_SRC=.baseline37s3/src bash bench/gpu_session.sh issue37s3  # third session: K/V widened to the query heads
#   bash bench/gpu_session.sh cudnn-diag           # issue 37: cuDNN's ragged attention against fp32, case by case
#   bash bench/gpu_session.sh issue37s4            # issue 37: B1/B2 (1.7B varlen; 0.6B flex vs varlen), B5 (one call)
#   bash bench/gpu_session.sh issue37s5            # issue 37: the acceptance files (B5, B1/B2) from the final commit
#   bash bench/gpu_session.sh issue37s5b           # issue 37: the flex/varlen crossover at 8192, budget 0.25, B2 profile
#   bash bench/gpu_session.sh multiserver          # issue 12 X5: one sync to two servers, one group each (two H200)
# Expects (carried, git-ignored): .assets/ (SmolLM2 tokenizer + prompts JSONL), .whl/ (gguf), .m1/.m2 (GGUF halves).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ASYNCGRPO_CACHE=$PWD/.assets ASYNCGRPO_DEMO_GGUF=/tmp/model/smollm2.gguf
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD/src
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpus.txt" 2>&1
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    tests)
      ASYNCGRPO_GPU_REPORT=$OUT/packing_gpu.jsonl timeout -s INT -k 30 ${TESTS_TIMEOUT:-330} python3 -m pytest -q -s -m gpu -p no:cacheprovider \
        ${GPU_TESTS:-tests/gpu} 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|PARITY|round|MiB|Error|error" | tail -40 ;;
    generation)
      timeout 260 python3 bench/generation.py --out "$OUT/generation_h200.json" 2>&1 | tee "$OUT/generation.log" | tail -25 ;;
    ipc)  # issue 38 B4-IPC: weight sync on one GPU against a bare copy; BASELINE_SRC=<a checkout's src> runs it first
      timeout 400 python3 bench/ipc_sync.py --iters 8 --modes packed:4096 packed:256 unpacked \
        --baseline-modes packed:4096 packed:256 unpacked ${BASELINE_SRC:+--baseline-src "$BASELINE_SRC"} \
        --out "$OUT/ipc_sync_h200.json" 2>&1 | tee "$OUT/ipc_sync.log" | grep -vE "it/s\]|s/it\]" | tail -20 ;;
    enginegc)  # GC pauses in the engine at B5's shape (the flat top-N change: CPU showed 6-7 full collections -> 0)
      timeout 200 python3 bench/probes/engine_gc.py --out "$OUT/engine_gc_h200.json" 2>&1 | tee "$OUT/engine_gc.log" | tail -6 ;;
    packing)
      timeout $((${PACKING_SECONDS:-300} + 40)) python3 bench/tree_packing.py --max-seconds ${PACKING_SECONDS:-300} --out "$OUT/tree_packing_h200.json" 2>&1 \
        | tee "$OUT/tree_packing.log" | tail -30 ;;
    profile37)  # issue 37's first call: B5 with its eager and graphed engine-step tables, then B1/B2 at the 1.7B shape
      # (compiled layers, checkpointing off and on) with a kernel table and a by-kind summary per tree method
      timeout 360 python3 bench/generation.py --profile --out "$OUT/generation_h200.json" 2>&1 | tee "$OUT/generation.log" \
        | grep -vE "it/s\]|s/it\]" | tail -60
      timeout $((${PACKING_SECONDS:-150} + 120)) python3 bench/tree_packing.py --compile --models qwen3-1.7b --skip-padded \
        --checkpointing both --max-seconds ${PACKING_SECONDS:-150} --profile "$OUT/tree_packing_profile.txt" \
        --out "$OUT/tree_packing_h200.json" 2>&1 | tee "$OUT/tree_packing.log" | tail -20
      [ -n "${MEMORY_BUDGET:-}" ] && timeout 200 python3 bench/tree_packing.py --compile --models qwen3-1.7b --skip-padded \
        --memory-budget "$MEMORY_BUDGET" --tree-backends varlen --max-seconds 60 --out "$OUT/tree_packing_budget_h200.json" 2>&1 \
        | tee "$OUT/tree_packing_budget.log" | tail -14
      # a call brings back 8 files at most: the logs and profile tables travel in one archive
      (cd "$OUT" && tar -czf profile37.tgz ./*.log ./*profile*.txt && rm -f ./*.log ./*profile*.txt) ;;
    issue37)  # issue 37's second call: B5 main (BASELINE_SRC) then this checkout (profiled, kernel sweep), B1/B2 profiled,
      # the engine's GPU tests; every file but the summaries goes into one archive (a call brings back 8 files at most)
      mkdir -p "$OUT/i37"
      PYTHONPATH=/tmp/site:$(cd "${BASELINE_SRC:?issue37 needs BASELINE_SRC}" && pwd) timeout 150 python3 bench/generation.py \
        --no-hf --no-sweep --out "$OUT/generation_baseline_h200.json" 2>&1 | tee "$OUT/i37/generation_baseline.log" | tail -6
      timeout 300 python3 bench/generation.py --profile --out "$OUT/generation_h200.json" 2>&1 | tee "$OUT/i37/generation.log" \
        | grep -vE "it/s\]|s/it\]|^decode kernel alone" | grep -A 12 "^\*\*engine step\|^B5 gen" | tail -50
      grep "^decode kernel alone" "$OUT/i37/generation.log"
      mv "$OUT"/generation_h200_*_profile.txt "$OUT/i37/" 2>/dev/null
      timeout $((${PACKING_SECONDS:-100} + 120)) python3 bench/tree_packing.py --compile --models qwen3-1.7b --skip-padded \
        --checkpointing both --max-seconds ${PACKING_SECONDS:-100} --profile "$OUT/i37/tree_packing_profile.txt" \
        --out "$OUT/tree_packing_h200.json" 2>&1 | tee "$OUT/i37/tree_packing.log" | grep -v "it/s\]" | tail -22
      timeout -s INT -k 20 ${TESTS_TIMEOUT:-150} python3 -m pytest -q -s -m gpu -p no:cacheprovider ${GPU_TESTS:-tests/gpu} 2>&1 \
        | tee "$OUT/i37/gpu_tests.log" | grep -E "passed|failed|Error" | tail -12
      cp "$OUT/gpus.txt" "$OUT/i37/"; tar -czf "$OUT/i37.tgz" -C "$OUT" i37 && rm -rf "$OUT/i37" ;;
    issue37s2)  # issue 37, second session: B1/B2 at both shapes (this checkout, checkpointing off and on; BASELINE_SRC
      # off), the GPU tests of the changed paths, a G=16 profile, the activation budget; logs in one archive
      mkdir -p "$OUT/s2"; P="python3 bench/tree_packing.py --compile --models qwen3-1.7b --skip-padded"
      timeout 200 $P --checkpointing both --max-seconds 150 --out "$OUT/tree_packing_h200.json" 2>&1 \
        | tee "$OUT/s2/tree_packing.log" | grep -v "it/s\]" | tail -24
      PYTHONPATH=/tmp/site:$(cd "${BASELINE_SRC:?issue37s2 needs BASELINE_SRC}" && pwd) timeout 120 $P --max-seconds 80 \
        --out "$OUT/tree_packing_baseline_h200.json" 2>&1 | tee "$OUT/s2/tree_packing_baseline.log" | grep -v "it/s\]" | tail -14
      ASYNCGRPO_GPU_REPORT=$OUT/packing_gpu.jsonl timeout -s INT -k 20 ${TESTS_TIMEOUT:-170} python3 -m pytest -q -s -m gpu \
        -p no:cacheprovider ${GPU_TESTS:-tests/gpu/test_fused_head_gpu.py tests/gpu/test_packing_gpu.py tests/gpu/test_step_gpu.py} \
        2>&1 | tee "$OUT/s2/gpu_tests.log" | grep -E "passed|failed|Error|in-GEMM|budget|varlen_kv" | tail -14
      timeout 100 $P --shapes G16_P2048_C256-1024 --max-seconds 40 --profile "$OUT/s2/g16_profile.txt" \
        --out "$OUT/tree_packing_g16_profile_h200.json" 2>&1 | tee "$OUT/s2/g16_profile.log" | grep -v "it/s\]" | tail -8
      timeout 90 $P --memory-budget 0.5 --tree-backends varlen --max-seconds 40 --out "$OUT/tree_packing_budget_h200.json" 2>&1 \
        | tee "$OUT/s2/budget.log" | grep -v "it/s\]" | tail -12
      cp "$OUT/gpus.txt" "$OUT/s2/"; tar -czf "$OUT/s2.tgz" -C "$OUT" s2 && rm -rf "$OUT/s2" ;;
    issue37s2b)  # issue 37, second session, call 3: the head kernels' GPU tests, where the step syncs, B1/B2 profiled at
      # both shapes (checkpointing off and on), BASELINE_SRC without checkpointing, activation budgets 0.5 and 0.25
      mkdir -p "$OUT/s2b"; P="python3 bench/tree_packing.py --compile --models qwen3-1.7b --skip-padded"
      timeout -s INT -k 20 150 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_fused_head_gpu.py \
        tests/gpu/test_step_gpu.py 2>&1 | tee "$OUT/s2b/gpu_tests.log" | grep -E "passed|failed|Error|in-GEMM|budget" | tail -10
      timeout 80 python3 bench/probes/step_syncs.py 2>&1 | tee "$OUT/s2b/step_syncs.log" | grep -v Warn | tail -8
      timeout 230 $P --checkpointing both --max-seconds 170 --profile "$OUT/s2b/tree_packing_profile.txt" \
        --out "$OUT/tree_packing_h200.json" 2>&1 | tee "$OUT/s2b/tree_packing.log" | grep -v "it/s\]" | tail -24
      PYTHONPATH=/tmp/site:$(cd "${BASELINE_SRC:?issue37s2b needs BASELINE_SRC}" && pwd) timeout 120 $P --max-seconds 80 \
        --out "$OUT/tree_packing_baseline_h200.json" 2>&1 | tee "$OUT/s2b/tree_packing_baseline.log" | grep -v "it/s\]" | tail -14
      for b in 0.5 0.25; do timeout 80 $P --memory-budget $b --tree-backends varlen --shapes G8_P512_C128-1536 \
        --out "$OUT/tree_packing_budget_${b}_h200.json" 2>&1 | tee "$OUT/s2b/budget_$b.log" | grep -v "it/s\]" | tail -5; done
      cp "$OUT/gpus.txt" "$OUT/s2b/"; tar -czf "$OUT/s2b.tgz" -C "$OUT" s2b && rm -rf "$OUT/s2b" ;;
    issue37s3)  # issue 37, third session: the packing GPU tests (the widened K/V gather), B1/B2 varlen at both shapes
      # for this checkout (checkpointing off and on, profiled with the idle gaps) then BASELINE_SRC, then B5
      mkdir -p "$OUT/s3"; P="python3 bench/tree_packing.py --compile --models qwen3-1.7b --skip-padded --tree-backends varlen"
      ASYNCGRPO_GPU_REPORT=$OUT/packing_gpu.jsonl timeout -s INT -k 20 170 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
        tests/gpu/test_packing_gpu.py 2>&1 | tee "$OUT/s3/gpu_tests.log" | grep -E "passed|failed|Error|widened" | tail -8
      timeout 230 $P --checkpointing both --max-seconds 190 --profile "$OUT/s3/tree_packing_profile.txt" \
        --out "$OUT/tree_packing_h200.json" 2>&1 | tee "$OUT/s3/tree_packing.log" | grep -v "it/s\]" | tail -20
      PYTHONPATH=/tmp/site:$(cd "${BASELINE_SRC:?issue37s3 needs BASELINE_SRC}" && pwd) timeout 100 $P --max-seconds 75 \
        --out "$OUT/tree_packing_baseline_h200.json" 2>&1 | tee "$OUT/s3/tree_packing_baseline.log" | grep -v "it/s\]" | tail -12
      timeout ${GENERATION_SECONDS:-120} python3 bench/generation.py --no-sweep --out "$OUT/generation_h200.json" 2>&1 \
        | tee "$OUT/s3/generation.log" | grep -vE "it/s\]|s/it\]" | tail -8
      cp "$OUT/gpus.txt" "$OUT/s3/"; tar -czf "$OUT/s3.tgz" -C "$OUT" s3 && rm -rf "$OUT/s3" ;;
    cudnn-diag)  # issue 37: cuDNN's ragged attention as torch exposes it, against fp32, case by case (under a minute)
      timeout 200 python3 bench/probes/cudnn_ragged_check.py --out "$OUT/cudnn_ragged_check_h200.jsonl" 2>&1 | cut -c1-500 ;;
    issue37s4)  # issue 37, fourth session: flex against varlen at the 0.6B shape (which backend "auto" should pick),
      # B1/B2 at the 1.7B shape (varlen, both shapes), then B5
      mkdir -p "$OUT/s4"; P="python3 bench/tree_packing.py --compile --skip-padded"
      timeout 150 $P --models qwen3-0.6b --tree-backends flex varlen --max-seconds 110 \
        --out "$OUT/tree_packing_06b_h200.json" 2>&1 | tee "$OUT/s4/tree_packing_06b.log" | grep -v "it/s\]" | tail -16
      timeout 200 $P --models qwen3-1.7b --tree-backends varlen --max-seconds 150 --out "$OUT/tree_packing_h200.json" 2>&1 \
        | tee "$OUT/s4/tree_packing.log" | grep -v "it/s\]" | tail -16
      timeout ${GENERATION_SECONDS:-120} python3 bench/generation.py --no-sweep --out "$OUT/generation_h200.json" 2>&1 \
        | tee "$OUT/s4/generation.log" | grep -vE "it/s\]|s/it\]" | tail -8
      cp "$OUT/gpus.txt" "$OUT/s4/"; tar -czf "$OUT/s4.tgz" -C "$OUT" s4 && rm -rf "$OUT/s4" ;;
    issue37s5)  # issue 37, fifth session, from the final commit: B5 with HF generate, the decode kernel sweep and the
      # engine-step profiles; B1/B2 at both model shapes (flat, flex and varlen trees, checkpointing off and on)
      mkdir -p "$OUT/s5"; P="python3 bench/tree_packing.py --compile --skip-padded"
      timeout 240 python3 bench/generation.py --profile --out "$OUT/generation_h200.json" > "$OUT/s5/generation.log" 2>&1
      grep -E "^decode kernel alone|steps, wall" "$OUT/s5/generation.log"; grep -A 14 "^B5 generation" "$OUT/s5/generation.log"
      mv "$OUT"/generation_h200_*_profile.txt "$OUT/s5/" 2>/dev/null
      timeout 250 $P --checkpointing both --max-seconds 210 --out "$OUT/tree_packing_h200.json" 2>&1 \
        | tee "$OUT/s5/tree_packing.log" | grep -v "it/s\]" | tail -34
      cp "$OUT/gpus.txt" "$OUT/s5/"; tar -czf "$OUT/s5.tgz" -C "$OUT" s5 && rm -rf "$OUT/s5" ;;
    issue37s5b)  # issue 37, fifth session: the flex/varlen crossover at token_budget 8192 ("auto"), the activation
      # budget 0.25 and a B2 kernel profile, at the 1.7B shape unless named
      mkdir -p "$OUT/s5b"; P="python3 bench/tree_packing.py --compile --skip-padded"
      timeout 90 $P --models qwen3-0.6b --shapes G8_P512_C128-1536 --tree-backends flex varlen --budget 8192 \
        --max-seconds 60 --out "$OUT/tree_packing_06b_8192_h200.json" 2>&1 | tee "$OUT/s5b/crossover.log" | grep -v "it/s\]" | tail -8
      timeout 80 $P --models qwen3-1.7b --shapes G8_P512_C128-1536 --tree-backends varlen --memory-budget 0.25 \
        --max-seconds 50 --out "$OUT/tree_packing_budget_0.25_h200.json" 2>&1 | tee "$OUT/s5b/budget.log" | grep -v "it/s\]" | tail -6
      timeout 120 $P --models qwen3-1.7b --tree-backends varlen --max-seconds 70 --profile "$OUT/s5b/tree_packing_profile.txt" \
        --out "$OUT/tree_packing_profile_h200.json" 2>&1 | tee "$OUT/s5b/profile.log" | grep -v "it/s\]" | tail -10
      cp "$OUT/gpus.txt" "$OUT/s5b/"; tar -czf "$OUT/s5b.tgz" -C "$OUT" s5b && rm -rf "$OUT/s5b" ;;
    packing-ab)  # B1/B2 at the 1.7B shape with compiled layers: BASELINE_SRC's src first, then this checkout's, one call
      for tag in baseline current; do
        src=$PWD/src; [ $tag = baseline ] && src=${BASELINE_SRC:?packing-ab needs BASELINE_SRC}
        [ $tag = baseline ] && src=$(cd "$src" && pwd)
        PYTHONPATH=/tmp/site:$src timeout $((${PACKING_SECONDS:-100} + 120)) python3 bench/tree_packing.py --compile \
          --models qwen3-1.7b --skip-padded --max-seconds ${PACKING_SECONDS:-100} --out "$OUT/tree_packing_${tag}_h200.json" 2>&1 \
          | tee "$OUT/tree_packing_$tag.log" | tail -14
      done ;;
    model-a) mkdir -p /tmp/model && cp .m1/part /tmp/model/a && ls -la /tmp/model ;;
    model-b) cat /tmp/model/a .m2/part > /tmp/model/smollm2.gguf && ls -la /tmp/model ;;
    train)
      timeout 330 python3 bench/two_gpu_run.py --data .assets/chain_sum_512.jsonl --steps 24 \
        --out "$OUT/two_gpu_run_h200x2.json" 2>&1 | tee "$OUT/two_gpu_run.log" | grep -vE "it/s\]|s/it\]" | tail -30 ;;
    fsdp)  # issue 12: two FSDP2 trainer ranks (GPUs 1,0) beside the server on GPU 0, then one rank
      timeout 400 python3 bench/fsdp_run.py --steps 30 --out "$OUT/fsdp_run_h200x2.json" 2>&1 \
        | tee "$OUT/fsdp_run.log" | grep -vE "it/s\]|s/it\]" | tail -40 ;;
    weightsync)  # issue 12 B4: bare broadcast vs WeightSender per bucket size with the breakdown; two-rank FSDP2
      timeout 560 python3 bench/weight_sync.py --fsdp2 --in-thread-modes packed:256 --out "$OUT/weight_sync_h200x2.json" 2>&1 \
        | tee "$OUT/weight_sync.log" | grep -vE "it/s\]|s/it\]" | tail -40 ;;
    agent)
      timeout 560 python3 bench/agent_learning.py --out "$OUT/agent_learning_h200.json" 2>&1 \
        | tee "$OUT/agent_learning.log" | grep -vE "it/s\]|s/it\]" | tail -30 ;;
    deltanet)  # issue 11 (P6): DeltaNet hybrids in the trie, CUDA parity + packed-vs-padded speed (one H200, ~3 min)
      export PYTHONPATH=$PYTHONPATH:$PWD
      timeout 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_deltanet_gpu.py 2>&1 \
        | tee "$OUT/deltanet_gpu_tests.log" | grep -E "PARITY|passed|failed|Error" | tail -20
      timeout 300 python3 bench/deltanet_packing.py --out "$OUT/deltanet_packing_h200.json" 2>&1 \
        | tee "$OUT/deltanet_packing.log" | grep -v "falling back" | tail -60 ;;
    rollout)
      timeout 480 python3 bench/rollout_path.py --repeats 3 --max-seconds 460 --out "$OUT/rollout_path_h200.json" 2>&1 \
        | tee "$OUT/rollout_path.log" | tail -40 ;;
    rollout-long)  # the same shapes x4 (1,024 requests, ~4 waves through 256 slots): the worker as a trainer feeds it
      timeout 560 python3 bench/rollout_path.py --scale 4 --repeats 2 --max-seconds 540 --variants in_process,worker,worker_group \
        --out "$OUT/rollout_path_scale4_h200.json" 2>&1 | tee "$OUT/rollout_path_x4.log" | tail -40 ;;
    learning)  # the settings of the last two-GPU runs (the data lies in bench/data)
      timeout 590 python3 bench/learning.py --train-seconds 150 --eval-every 30 --token-budget 16384 \
        --learning-rate 1e-5 --out "$OUT/learning_h200x2.json" 2>&1 | tee "$OUT/learning.log" \
        | grep -vE "it/s\]|s/it\]" | tail -40 ;;
    learning-b6)  # B6 where training weighs about as much as generation: checkpointing on (sync's split is in the JSON)
      timeout 590 python3 bench/learning.py --train-seconds 150 --eval-every 30 --token-budget 16384 \
        --learning-rate 1e-5 --gradient-checkpointing --out "$OUT/learning_b6_h200x2.json" 2>&1 | tee "$OUT/learning_b6.log" \
        | grep -vE "it/s\]|s/it\]" | tail -40 ;;
    share-probe)  # issue 38 B6-1GPU: a training step beside a decoding process, time-sliced vs MPS (one H200, ~3 min)
      timeout 260 python3 bench/probes/gpu_share_probe.py --seconds 10 --setup-s 20 --out "$OUT/gpu_share_probe_h200.json" \
        2>&1 | tee "$OUT/gpu_share_probe.log" | tail -12 ;;
    ipc-mps)  # the ipc weight-sync GPU tests with server and trainer as clients of one private MPS daemon
      mkdir -p /tmp/mps/pipe /tmp/mps/log
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
      if ! nvidia-cuda-mps-control -d; then echo "no MPS here"; continue; fi
      timeout 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider tests/gpu/test_ipc_sync_gpu.py 2>&1 \
        | tee "$OUT/ipc_mps_tests.log" | grep -E "passed|failed|Error|error" | tail -10
      echo get_server_list | nvidia-cuda-mps-control; echo quit | nvidia-cuda-mps-control
      tail -5 /tmp/mps/log/control.log 2>/dev/null
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY ;;
    b6-mps)  # issue 38 B6-1GPU: random-init 360M shape, sync vs async, time-sliced and under the run's MPS daemon
      timeout 560 python3 bench/learning.py --random-init smollm2-360m --tokenizer .assets/SmolLM2-135M-Instruct-tokenizer \
        --task chain_sum --server-gpu 0 --trainer-gpu 0 --server-args='--gpu-memory-utilization 0.3' \
        --modes ${B6_MODES:-sync,async,async_mps,sync_mps} --train-seconds 55 --eval-every 1000 --token-budget 10240 \
        --learning-rate 1e-5 --out "$OUT/${B6_OUT:-learning_b6_h200}.json" 2>&1 | tee "$OUT/learning_b6.log" \
        | grep -vE "it/s\]|s/it\]" | tail -30 ;;
    learning-1gpu)  # issue 38 stage 4: B8 on one H200 (server and trainer share it, ipc), 2 seeds x async/sync
      timeout 590 python3 bench/learning.py --task chain_sum --server-gpu 0 --trainer-gpu 0 \
        --server-args='--gpu-memory-utilization 0.3' --modes async,sync --seeds ${SEEDS:-0,1} --train-seconds 60 \
        --eval-every 30 --token-budget 8192 --learning-rate 1e-5 --heldout-limit 100 \
        --out "$OUT/learning_1gpu_h200.json" 2>&1 | tee "$OUT/learning_1gpu.log" | grep -vE "it/s\]|s/it\]" | tail -30 ;;
    ttl)  # issue 41: time to learning, today's main (BASELINE_SRC) then this checkout, random-init SmolLM2-135M shape
      # the image's venv ships no .pyc and sets PYTHONDONTWRITEBYTECODE: compile site-packages once, as `pip install`
      # does, so that neither variant's first run pays ~6 s per process for it (TTL_PRECOMPILE=0: leave it as it is)
      if [ "${TTL_PRECOMPILE:-1}" != 0 ]; then
        t0=$SECONDS; sp=$(python3 -c "import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec('torch').origin)))")
        python3 -m compileall -q -j 16 "$sp" > /dev/null 2>&1; echo "bytecode of $sp compiled in $((SECONDS - t0)) s" | tee "$OUT/precompile.txt"
      fi
      timeout ${TTL_TIMEOUT:-560} python3 bench/time_to_learning.py --random-init --max-completion-length 40 --steps ${TTL_STEPS:-30} \
        ${BASELINE_SRC:+--baseline-src "$BASELINE_SRC"} ${TTL_RUNS:+--runs "$TTL_RUNS"} ${TTL_BASELINE_RUNS:+--baseline-runs "$TTL_BASELINE_RUNS"} --profile-steps 20-22 --run-timeout 110 \
        --out "$OUT/time_to_learning_h200.json" 2>&1 | tee "$OUT/ttl.log" | grep -vE "^\{'|it/s\]" | tail -20
      rm -rf "$OUT"/time_to_learning_h200_runs/random-135m
      tar -czf "$OUT/ttl_runs.tgz" -C "$OUT" time_to_learning_h200_runs time_to_learning_h200_profile 2>/dev/null
      rm -rf "$OUT"/time_to_learning_h200_runs "$OUT"/time_to_learning_h200_profile ;;
    ssp)  # issue 41: the packed step alone at the 135M shape, per backend/compile variant, with profiler tables
      timeout 240 python3 bench/probes/small_step_probe.py --out "$OUT/small_step_probe_h200.json" --profile-dir "$OUT/ssp" \
        ${SSP_VARIANTS:+--variants "$SSP_VARIANTS"} \
        2>&1 | grep -vi warn | tail -8
      tar -czf "$OUT/ssp.tgz" -C "$OUT" ssp && rm -rf "$OUT/ssp" ;;
    estart)  # issue 41: the embedded server's start beside a trainer-side load, cold then warm, profiled per process
      mkdir -p "$OUT/estart"
      timeout 300 python3 bench/probes/engine_start_probe.py --runs 3 --cprofile --out "$OUT/estart/engine_start_h200.json" 2>&1 \
        | tail -30
      cp "$OUT/estart/engine_start_h200.json" "$OUT/" 2>/dev/null
      tar -czf "$OUT/estart.tgz" -C "$OUT" estart && rm -rf "$OUT/estart" ;;
    imports)  # issue 41: the server's transformers import, scikit-learn hidden (server/lean_imports.py) or not
      for mode in plain lean; do
        python3 -X importtime -c "
import sys, time; t = time.time()
from asyncgrpo.server import lean_imports
lean_imports.enable() if '$mode' == 'lean' else None
with lean_imports.without_unused_packages():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import transformers.models.llama.modeling_llama
print('$mode', 'import s', round(time.time() - t, 2), 'sklearn' in sys.modules, file=sys.stderr)" 2> "$OUT/importtime_$mode.txt"
        grep -E "^(plain|lean) " "$OUT/importtime_$mode.txt"; sort -t'|' -k2 -n "$OUT/importtime_$mode.txt" | tail -12
      done ;;
    timports)  # issue 41: the trainer process's imports as `asyncgrpo train` makes them (second of two runs: bytecode kept)
      for i in 1 2; do
        python3 -X importtime -c "
import sys, time; t = time.time()
from asyncgrpo.server.bytecode import keep_bytecode
keep_bytecode()
from asyncgrpo.cli.launch import import_config
from asyncgrpo.server import lean_imports
lean_imports.enable()
import_config()
import torch
from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
print('trainer imports s', round(time.time() - t, 2), file=sys.stderr)" 2> "$OUT/trainer_importtime.txt"
      done
      grep "trainer imports" "$OUT/trainer_importtime.txt"; sort -t'|' -k2 -n "$OUT/trainer_importtime.txt" | tail -25 ;;
    graphs)  # issue 41: CUDA graphs of the step against the eager step (GPU tests)
      python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
      ASYNCGRPO_GPU_REPORT=$OUT/packing_gpu.jsonl timeout ${GRAPHS_TIMEOUT:-300} python3 -m pytest -q -s -m gpu -p no:cacheprovider ${GRAPHS_TESTS:-tests/gpu/test_graphed_step_gpu.py} 2>&1 \
        | tee "$OUT/graphed_step_gpu.log" | grep -E "passed|failed|amp=|Error|error|assert" | tail -30 ;;
    multiserver)
      timeout 400 python3 bench/multi_server_sync.py --out "$OUT/multi_server_sync_h200x2.json" 2>&1 \
        | tee "$OUT/multi_server_sync.log" | tail -30 ;;
    *) echo "unknown stage $stage" ;;
  esac
done
echo "=== done $(date +%T)"

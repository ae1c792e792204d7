#!/usr/bin/env bash
# Issue 41: one cold time-to-learning run on the GPU machine, then the child log lines that say why the step's CUDA graphs went off.
OUT=${OUT:-$PWD/gpu-out}; export OUT TTL_PRECOMPILE=0 TTL_STEPS=6
TTL_RUNS=${TTL_RUNS:-async_cold,async_warm} TTL_TIMEOUT=${TTL_TIMEOUT:-240} bash bench/gpu_session.sh ttl
mkdir -p /tmp/r && tar xzf $OUT/ttl_runs.tgz -C /tmp/r && rm -f $OUT/ttl_runs.tgz
for f in /tmp/r/time_to_learning_h200_runs/current/*.log; do echo "##### $f"; grep -iE "graph|warm|WARN|Error|Traceback|recompil" $f | grep -v "it/s" | cut -c1-700 | head -40; cp $f $OUT/; done

#!/usr/bin/env bash
# ZeroMQ's round trip on the GPU machine with nothing of vkpool on it (`python -m bench.zmq_floor`):
# the four polling combinations, then the server busy before each answer with each way of placing
# the threads, ROUNDS times. Carry .gl .whl .glsl. Output under $OUT.
set -uo pipefail
source bench/gpu_daemon_env.sh > /dev/null
lscpu | grep -E "Model name|^CPU\(s\)" | tee "$OUT/zmq-floor.md"
for r in $(seq 1 "${ROUNDS:-2}"); do
  echo "=== round $r"
  (cd /tmp && timeout 200 python3 -m bench.zmq_floor --runs "${RUNS:-5000}" ${ARGS:-})
done 2>&1 | tee -a "$OUT/zmq-floor.md"

#!/usr/bin/env bash
# On a GPU machine with two GPUs: the daemon's jobs/s over the local lane with the model on one GPU
# (objective latency) and replicated on both (--objective throughput), fixed batch and dynamic
# batching (python -m vkpool.daemon.bench). Carry .gl, .whl and .glsl as for bench/gpu_run.sh.
# Environment: MODEL, CLIENTS, SECONDS_EACH, MAX_BATCH.
source bench/gpu_daemon_env.sh
(cd /tmp && python3 -m vkpool devices | head -4)
common="--runs 200 --seconds ${SECONDS_EACH:-2} --clients ${CLIENTS:-1 16 64} --transport lane"
for batching in "" "--max-batch ${MAX_BATCH:-32}"; do
  for objective in latency throughput; do
    echo "=== objective $objective ${batching:-fixed batch}"
    (cd /tmp && timeout 150 python3 -m vkpool.daemon.bench ${MODEL:-mnist12_like} $common $batching \
      --objective $objective 2>&1 | grep -E "^\| [a-z]|^Models")
  done
done

#!/usr/bin/env bash
# On the GPU machine: python -m bench.daemon_shards (clients dealt to 1, 2, 4, 8 daemon processes,
# fixed batch and dynamic batching), then bench/gpu_daemon_profile.sh's figures and profiles unless
# SKIP_PROFILE is set. Carry .gl, .whl (py-spy among the wheels) and .glsl as for bench/gpu_run.sh.
# Environment: MODEL, SHARDS, CLIENTS, SECONDS_EACH, MAX_BATCH.
source bench/gpu_daemon_env.sh
args="${MODEL:-mnist12_like} --shards ${SHARDS:-1 2 4 8} --clients ${CLIENTS:-16 64} --seconds ${SECONDS_EACH:-3}"
(cd /tmp && timeout 240 python3 -m bench.daemon_shards $args 2>&1 | tail -8 | tee "$OUT/shards-fixed.md")
(cd /tmp && timeout 240 python3 -m bench.daemon_shards $args --max-batch ${MAX_BATCH:-32} 2>&1 | tail -8 \
  | tee "$OUT/shards-batched.md")
[ -n "${SKIP_PROFILE:-}" ] || bash bench/gpu_daemon_profile.sh

#!/usr/bin/env bash
# On the GPU machine: the daemon's jobs/s with the CPU it and its clients use (python -m
# vkpool.daemon.bench), then py-spy profiles of the daemon under 16 clients (all threads, and only
# the thread holding the GIL). Carry .gl, .whl (with py-spy) and .glsl as for bench/gpu_run.sh.
# Environment: MODEL, CLIENTS, SECONDS_EACH, MAX_BATCH, TRANSPORT.
source bench/gpu_daemon_env.sh
common="--runs 300 --seconds ${SECONDS_EACH:-2} --clients ${CLIENTS:-1 4 16 64} --transport ${TRANSPORT:-both}"
for mode in fixed batched; do
  extra=""; [ $mode = batched ] && extra="--max-batch ${MAX_BATCH:-32}"
  echo "=== $mode"
  (cd /tmp && timeout 200 python3 -m vkpool.daemon.bench ${MODEL:-mnist12_like} $common $extra \
    --out "$OUT/daemon-$mode.json" 2>&1 | grep -E "^\| |^CPU")
done
for gil in "" --gil; do
  echo "=== profile: 16 clients, batched, lane $gil"
  mkdir -p /tmp/prof$gil
  (cd /tmp && timeout 120 python3 -m bench.daemon_profile ${MODEL:-mnist12_like} --clients 16 --seconds 4 \
    --max-batch ${MAX_BATCH:-32} --transport lane $gil --out /tmp/prof$gil 2>&1 | head -32)
  cp /tmp/prof$gil/daemon-profile.txt "$OUT/daemon-profile$gil.txt"
done

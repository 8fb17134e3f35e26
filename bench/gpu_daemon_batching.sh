#!/usr/bin/env bash
# On the GPU machine: the daemon's jobs/s with 1..64 client processes, without and with dynamic
# batching (python -m vkpool.daemon.bench). Carry .gl, .whl and .glsl as for bench/gpu_run.sh.
# Usage: bash bench/gpu_daemon_batching.sh [name]   Environment: MODELS, CLIENTS, SECONDS, MAX_BATCH,
# MAX_DELAY_US, TRANSPORT (zmq, lane or both).
set -uo pipefail
name=${1:-daemon-batching}
OUT=${OUT:-/tmp/out}
bash bench/gpu_run.sh "$name" "" --devices-only > /dev/null || exit 1
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] || icd=$(ls /usr/share/vulkan/icd.d/nvidia*.json /etc/vulkan/icd.d/nvidia*.json 2>/dev/null | head -1)
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
export VK_DRIVER_FILES=$icd VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg
cd /tmp
common="--runs ${RUNS:-1000} --seconds ${SECONDS_EACH:-3} --clients ${CLIENTS:-1 4 16 64} --transport ${TRANSPORT:-both}"
timeout 280 python3 -m vkpool.daemon.bench ${MODELS:-mnist12_like} $common \
  --out "$OUT/daemon-$name-fixed.json" 2>&1 | tail -12
timeout 280 python3 -m vkpool.daemon.bench ${MODELS:-mnist12_like} $common --max-batch ${MAX_BATCH:-32} \
  --max-delay-us ${MAX_DELAY_US:-0} --out "$OUT/daemon-$name-batched.json" 2>&1 | tail -12

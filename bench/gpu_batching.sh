#!/usr/bin/env bash
# On the GPU machine: the workloads' check and latency (bench/gpu_run.sh), then in-process dynamic
# batching (python -m bench.batching) on a symbolic-batch export of each BATCH_WORKLOADS.
# Carry .gl, .whl and .glsl as for bench/gpu_run.sh. Usage: bash bench/gpu_batching.sh [name]
set -uo pipefail
name=${1:-batching}
OUT=${OUT:-/tmp/out}
bash bench/gpu_run.sh "$name" || exit 1
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] || icd=$(ls /usr/share/vulkan/icd.d/nvidia*.json /etc/vulkan/icd.d/nvidia*.json 2>/dev/null | head -1)
export VK_DRIVER_FILES=$icd VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg
cd /tmp
timeout "${BATCH_TIMEOUT:-240}" python3 -m bench.batching ${BATCH_WORKLOADS:-mnist12_like} \
  --clients ${BATCH_CLIENTS:-1 4 16 64} --seconds ${BATCH_SECONDS:-3} --max-batch ${MAX_BATCH:-32} \
  --max-delay-us ${MAX_DELAY_US:-0} --out "$OUT/batching-$name.json" 2>&1 | tee "$OUT/batching-$name.md"

#!/usr/bin/env bash
# On the GPU machine: the daemon's jobs/s with p50/p99 latency (python -m vkpool.daemon.bench) at
# 1, 4, 16 and 64 client processes, fixed batch and dynamic batching, for this tree and, where .base
# holds another tree (`git archive REV | tar -x -C .base`), for that one in the same call, so that
# both run on the same card; then a py-spy profile of this tree's daemon under 16 batched clients.
# Carry .gl, .whl (py-spy among the wheels), .glsl and .base as for bench/gpu_run.sh.
# Usage: bash bench/gpu_daemon_ab.sh   Environment: MODELS (fixed-batch figures, default
# mnist12_like), BATCHED (default mnist12_like), CLIENTS, SECONDS_EACH, MAX_BATCH, TREES (new base).
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash bench/gpu_run.sh daemon "" --devices-only > "$OUT/setup.txt" 2>&1 || { cat "$OUT/setup.txt"; exit 1; }
head -3 "$OUT/nvidia-smi-daemon.txt"
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] || icd=$(ls /usr/share/vulkan/icd.d/nvidia*.json /etc/vulkan/icd.d/nvidia*.json 2>/dev/null | head -1)
export VK_DRIVER_FILES=$icd VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
trees="${TREES:-new}"
if [ -d .base ] && [ -z "${TREES:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/vkpool-base ./.base \
    > /dev/null && trees="new base"
fi
common="--runs ${RUNS:-1000} --seconds ${SECONDS_EACH:-2} --clients ${CLIENTS:-1 4 16 64} --transport both"
for tree in $trees; do
  src=/tmp/vkpool-src; [ "$tree" = base ] && src=/tmp/vkpool-base
  export PYTHONPATH=/tmp/site:$src:/tmp/benchpkg
  echo "=== $tree: fixed batch"
  (cd /tmp && timeout 250 python3 -m vkpool.daemon.bench ${MODELS:-mnist12_like} $common \
    --out "$OUT/daemon-$tree-fixed.json" 2>&1 | tail -n +3)
  echo "=== $tree: dynamic batching"
  (cd /tmp && timeout 250 python3 -m vkpool.daemon.bench ${BATCHED:-mnist12_like} $common \
    --max-batch ${MAX_BATCH:-32} --out "$OUT/daemon-$tree-batched.json" 2>&1 | tail -n +3)
done
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg
echo "=== profile: new, 16 clients, batched, lane"
(cd /tmp && timeout 120 python3 -m bench.daemon_profile mnist12_like --clients 16 --seconds 5 \
  --max-batch ${MAX_BATCH:-32} --transport lane --out "$OUT" 2>&1 | tail -45)

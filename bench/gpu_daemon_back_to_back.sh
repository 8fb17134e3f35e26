#!/usr/bin/env bash
# On the GPU machine: the daemon's jobs/s over the local lane with back_to_back at its default (8:
# a worker runs a model's jobs back to back, the next started on the device behind the one
# running) and at 1 (one job at a time), alternating, ROUNDS rounds (python -m vkpool.daemon.bench).
# Carry .gl, .whl and .glsl as for bench/gpu_run.sh. Environment: MODELS, CLIENTS, SECONDS_EACH,
# RUNS, ROUNDS, TRANSPORT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash bench/gpu_run.sh back-to-back "" --devices-only > /dev/null || exit 1
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] || icd=$(ls /usr/share/vulkan/icd.d/nvidia*.json /etc/vulkan/icd.d/nvidia*.json 2>/dev/null | head -1)
export VK_DRIVER_FILES=$icd VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg
printf 'daemon:\n  back_to_back: 1\n' > /tmp/one-at-a-time.yaml
cd /tmp
common="--runs ${RUNS:-300} --seconds ${SECONDS_EACH:-2} --clients ${CLIENTS:-1 4 16 64} --transport ${TRANSPORT:-lane}"
for round in $(seq 1 "${ROUNDS:-2}"); do
  for setting in default one; do
    config=(); [ "$setting" = one ] && config=(--config /tmp/one-at-a-time.yaml)
    echo "== round $round, back_to_back ${setting/default/8 (default)}"
    timeout 200 python3 -m vkpool.daemon.bench ${MODELS:-mnist12_like} $common "${config[@]}" \
      --out "$OUT/daemon-b2b-$setting-$round.json" 2>&1 | tail -8
  done
done

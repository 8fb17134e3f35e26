#!/usr/bin/env bash
# On a GPU machine with two GPUs: the replicas figure of bench.cluster --gpus (bench/gpu_cluster.sh)
# for every setting in CALLS at each window in WINDOWS, two nodes also at twice the window
# (--same-load), output under $OUT. Carry .gl, .whl, .glsl and .ray as for bench/gpu_cluster.sh.
# Usage: CALLS="64x4 128x4" WINDOWS="256 512" LOAD=callbacks bash bench/gpu_cluster_calls.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
for window in ${WINDOWS:-256 512}; do
  OUT=$OUT bash bench/gpu_cluster.sh --figures replicas --window "$window" --seconds "${SECONDS_PER:-4}" \
    --same-load --load ${LOAD:-callbacks} --calls ${CALLS:-64x4 128x4 256x4} || exit 1
  mv "$OUT/cluster-gpus.txt" "$OUT/cluster-gpus-window$window.txt"
done
# the session's own Python per request on this machine's CPU (no Ray), to set beside the figures
(export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg; cd /tmp && python3 -m bench.driver_cost && \
 python3 -m bench.driver_cost --max-bundle 128) > "$OUT/driver-cost.txt" 2>&1
cat "$OUT/driver-cost.txt"
for window in ${WINDOWS:-256 512}; do
  echo "== window $window"; sed -n '/^window /,$p' "$OUT/cluster-gpus-window$window.txt"
done

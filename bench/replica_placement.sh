#!/usr/bin/env bash
# On a machine with two GPUs set up by `bash bench/gpu_run.sh NAME x --devices-only`:
#   bash bench/replica_placement.sh NAME [REPEATS]
# mnist12_like replicated on both GPUs, REPEATS fresh starts each: free placement, then the
# calling process and its worker processes confined to four processors (taskset; the workers
# inherit it); PLACEMENTS lists them (default "free 0,2,4,6"). Prints the processor topology
# first. Writes NAME-placement.md under $OUT.
set -uo pipefail
name=${1:-placement}; repeats=${2:-3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg VKPOOL_CACHE_DIR=/tmp/vkcache
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
cd /tmp
{
  lscpu | grep -E "Model name|Socket|Core|Thread|NUMA|L3"
  lscpu -e=CPU,CORE,SOCKET,NODE,MAXMHZ | head -40
  for how in ${PLACEMENTS:-free 0,2,4,6}; do
    for k in $(seq 1 "$repeats"); do
      echo "## $how, start $k"
      if [ "$how" = free ]; then run=(); else run=(taskset -c "$how"); fi
      timeout 120 "${run[@]}" python3 -m bench.multi_gpu --parts replicated --workloads mnist12_like --requests 4000 \
        | grep -E "^\| mnist" | sed -E 's/caller (cpu[0-9]+)[^;]*;/caller \1;/'
    done
  done
} 2>&1 | tee "$OUT/$name-placement.md"

#!/usr/bin/env bash
# On a machine with two GPUs, after `bash bench/gpu_run.sh NAME --lvp --devices-only` set it up
# (with Mesa's lavapipe carried in .lvp, so the pool has llvmpipe as the host side):
#   bash bench/multi_gpu_runs.sh NAME [REPEATS]
# runs every part of bench.multi_gpu once, then the replicated part REPEATS more times (each in a
# fresh process: where the scheduler puts the processes differs from one start to the next), and
# writes NAME-*.md / NAME-*.json under $OUT.
set -uo pipefail
name=${1:-multi}; repeats=${2:-2}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg LD_LIBRARY_PATH=/tmp/lvp/lib VKPOOL_CACHE_DIR=/tmp/vkcache
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export VK_DRIVER_FILES=$icd$([ -f /tmp/lvp/lvp_icd.json ] && echo :/tmp/lvp/lvp_icd.json)
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
cd /tmp
python3 -m vkpool devices
timeout 400 python3 -m bench.multi_gpu --out "$OUT/$name-all.json" > "$OUT/$name-all.md" 2>&1
cat "$OUT/$name-all.md"
for k in $(seq 1 "$repeats"); do
  timeout 120 python3 -m bench.multi_gpu --parts replicated --out "/tmp/$name-rep$k.json" 2>&1
done > "$OUT/$name-replicated.md"
cat "$OUT/$name-replicated.md"
python3 -c "import json,sys; json.dump([json.load(open(f)) for f in sys.argv[1:]], open('$OUT/$name-replicated.json','w'), indent=1)" /tmp/$name-rep*.json

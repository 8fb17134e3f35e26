#!/usr/bin/env bash
# On a machine with two GPUs set up by `bash bench/gpu_run.sh NAME --lvp --devices-only`:
#   bash bench/multi_gpu_final.sh NAME [REPEATS]
# every part of bench.multi_gpu once, the split part again with the tensors crossing between
# chunks written and read in place (--in-place), then the replicated part
# REPEATS more times in fresh processes. Writes NAME-*.md / NAME-*.json under $OUT.
set -uo pipefail
name=${1:-final}; repeats=${2:-2}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg LD_LIBRARY_PATH=/tmp/lvp/lib VKPOOL_CACHE_DIR=/tmp/vkcache
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export VK_DRIVER_FILES=$icd$([ -f /tmp/lvp/lvp_icd.json ] && echo :/tmp/lvp/lvp_icd.json)
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
cd /tmp
timeout 240 python3 -m bench.multi_gpu --out "$OUT/$name-all.json" > "$OUT/$name-all.md" 2>&1
timeout 150 python3 -m bench.multi_gpu --parts split --in-place --out "$OUT/$name-split-in-place.json" > "$OUT/$name-split-in-place.md" 2>&1
for k in $(seq 1 "$repeats"); do
  timeout 60 python3 -m bench.multi_gpu --parts replicated --out "/tmp/$name-rep$k.json" 2>&1
done > "$OUT/$name-replicated.md"
python3 -c "import json,sys; json.dump([json.load(open(f)) for f in sys.argv[1:]], open('$OUT/$name-replicated.json','w'), indent=1)" /tmp/$name-rep*.json
cat "$OUT/$name-all.md" "$OUT/$name-split-in-place.md" "$OUT/$name-replicated.md" | grep -v "^$"

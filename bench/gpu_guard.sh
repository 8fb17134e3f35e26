#!/usr/bin/env bash
# On the GPU machine: in-process latency of this checkout against another tree (BASE, a folder with
# that commit's files, e.g. `git archive <commit> | tar -x -C .base`), alternating A B A B, on the
# same warm GPU. Carry .gl, .whl, .glsl and the BASE folder. Usage: bash bench/gpu_guard.sh BASE [WORKLOADS...]
set -uo pipefail
base=${1:?a folder with the baseline tree}; shift
OUT=${OUT:-/tmp/out}
bash bench/gpu_run.sh guard "" --devices-only > /dev/null || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/vkpool-base "$base" >/dev/null || exit 1
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export VK_DRIVER_FILES=$icd VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
cd /tmp
PYTHONPATH=/tmp/site:/tmp/benchpkg python3 -m bench.workloads --out /tmp/models ${*:-mnist12_like add_chain_1 matmul_1GB_16layers} > /dev/null
for round in 1 2; do
  for tree in vkpool-src vkpool-base; do
    for w in ${*:-mnist12_like add_chain_1 matmul_1GB_16layers}; do
      echo "== $tree round $round $w"
      PYTHONPATH=/tmp/site:/tmp/$tree timeout 120 python3 -m vkpool run /tmp/models/$w.onnx --device vk0 --repeat 300 | grep latency
    done
  done
done 2>&1 | tee "$OUT/guard.txt"

#!/usr/bin/env bash
# bench/gpu_fp16.sh's set-up (skipped where a warm machine already has it), then "$@" with its
# environment: quick follow-up runs on the GPU machine, e.g.
#   bash bench/gpu_fp16_warm.sh python3 -m bench.fp16_policies /tmp/models/bert-fp16.onnx --policies planner=
# Carry .gl, .whl, .glsl and .cur (a `git archive` of the tree to run, installed when given).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
tree=${TREE:-.cur}
if [ ! -f /tmp/models/bert-fp16.onnx ] || [ ! -d /tmp/site ] || [ "${FRESH:-0}" = 1 ]; then
  (cd "$tree" && for c in .gl .whl .glsl; do [ -e $c ] || ln -s ../$c .; done && \
   bash bench/gpu_fp16.sh profile policies fp32 tests gemm > "$OUT/setup-headline.txt" 2>&1)
else
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/vkpool-src "$tree" > /dev/null
  rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r "$tree/bench" "$tree/tests" /tmp/benchpkg/
fi
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json VKPOOL_CACHE_DIR=/tmp/vkcache
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg PYTHONUNBUFFERED=1
cd /tmp && "$@"

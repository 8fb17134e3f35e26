#!/usr/bin/env bash
# On the GPU machine, after bench/gpu_fp16.sh with BASE (both trees installed, the float16 models
# exported): the two trees alternately, ROUNDS times (default 3), each timing the float16 models
# with the planner's own products (python -m bench.fp16_policies --policies planner=): the host
# median of Session.run and the GPU time of the run's commands, which varies far less between
# calls than the host's. Output: $OUT/ab.txt. Usage: BASE=.base bash bench/gpu_fp16_ab.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
for r in $(seq 1 "${ROUNDS:-3}"); do
  for tree in src base; do
    echo "=== round $r, $tree"
    (cd /tmp && PYTHONPATH=/tmp/site:/tmp/vkpool-$tree:/tmp/benchpkg timeout 120 python3 -m bench.fp16_policies \
      /tmp/models/bert-fp16.onnx /tmp/models/gpt2-fp16.onnx --device vk0 --runs 200 --policies planner= 2>&1 \
      | grep -E "^\| planner|rror")
  done
done 2>&1 | tee "$OUT/ab.txt"

#!/usr/bin/env bash
# On the GPU machine: the transformer models of bench.real_models (BERT-base, GPT-2 small) beside
# torch's CUDA graph in the same run, then GPU timestamps per dispatch of each (bench.gpu_profile),
# so the table says how far off vkpool is and the profile says where the time goes. With BASE (a
# folder holding another tree, e.g. `git archive <commit> | tar -x -C .base`), that tree's vkpool
# is timed too, in the same run.
# PROFILE lists the models to profile (default: all of them).
# Carry .gl, .whl, .glsl (and BASE). Usage: [BASE=.base] [PROFILE=...] bash bench/gpu_transformers.sh [MODELS...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash bench/gpu_run.sh tf "" --devices-only > /dev/null || exit 1
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export VK_DRIVER_FILES=$icd VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
if [ -n "${BASE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/vkpool-base "$BASE" \
    >/dev/null || exit 1
fi
cd /tmp
models=${*:-bert gpt2}
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg
timeout 400 python3 -m bench.real_models --models $models --runtimes vkpool torch_cudagraph \
  --models-dir /tmp/models --device vk0 --runs 100 --out "$OUT/real-models.json" 2>&1 | tee "$OUT/real-models.txt"
if [ -n "${BASE:-}" ]; then
  PYTHONPATH=/tmp/site:/tmp/vkpool-base:/tmp/benchpkg timeout 300 python3 -m bench.real_models --models $models \
    --runtimes vkpool --models-dir /tmp/models --device vk0 --runs 100 --out "$OUT/real-models-base.json" 2>&1 \
    | tee "$OUT/real-models-base.txt"
fi
for m in ${PROFILE-$models}; do
  timeout 120 python3 -m bench.gpu_profile /tmp/models/$m.onnx --device vk0 --top 25
done 2>&1 | tee "$OUT/gpu-profile.txt"

#!/usr/bin/env bash
# On the GPU machine, in one call: this tree against BASE (bench/gpu_tree_ab.sh, MODELS at batch
# 1 and ResNet-50 at BATCH), then the costliest dispatches of ResNet-50 at batch BATCH and 1 with
# their products (python -m bench.gpu_profile --shapes): where Winograd's stages go. Carry .gl
# .whl .glsl and BASE. Output under $OUT. Environment: MODELS (default resnet50 unet), BATCH
# (16), ROUNDS (2), TOP (40).
set -uo pipefail
MODELS=${MODELS-resnet50 unet} bash bench/gpu_tree_ab.sh
source bench/gpu_daemon_env.sh > /dev/null
cd /tmp
for model in /tmp/models/resnet50-b${BATCH:-16}.onnx /tmp/models/resnet50.onnx; do
  timeout 200 python3 -m bench.gpu_profile $model --device vk0 --shapes --top ${TOP:-40} 2>&1 \
    | tee -a "$OUT/profile.md" | grep -E "^\| (gemm|winograd|binary|gemm_reduce|conv)|first to last"
done

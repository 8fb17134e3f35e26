#!/usr/bin/env bash
# On the GPU machine, in one call: ResNet-50 (and MODELS) at batch 1 and at BATCH (default 16),
# vkpool beside torch's float32 CUDA graph (python -m bench.real_models --batch), then the GPU time
# of every dispatch of vkpool's run at BATCH (python -m bench.gpu_profile). Carry .gl, .whl and
# .glsl as for bench/gpu_run.sh. Output under $OUT. Environment: MODELS (default resnet50), BATCH,
# RUNS (default 30), TOP (dispatches listed, default 30), PROFILE (0: no profile).
source bench/gpu_daemon_env.sh
cd /tmp
models=${MODELS:-resnet50}
for b in 1 ${BATCH:-16}; do
  echo "=== batch $b"
  timeout 400 python3 -m bench.real_models --models $models --batch $b --runtimes vkpool torch_cudagraph \
    --runs ${RUNS:-30} --warmup 5 --device vk0 --models-dir /tmp/models --out "$OUT/real-models-b$b.json" 2>&1 \
    | grep -E "^\||median|error|Error"
done
[ "${PROFILE:-1}" = 0 ] && exit 0
for m in $models; do
  echo "=== profile: $m, batch ${BATCH:-16}"
  timeout 200 python3 -m bench.gpu_profile /tmp/models/$m-b${BATCH:-16}.onnx --device vk0 --top ${TOP:-30} 2>&1
done | tee "$OUT/gpu-profile.txt"

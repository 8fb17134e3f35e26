#!/usr/bin/env bash
# On the GPU machine, in one call: the costliest dispatches of ResNet-50 at batch BATCH (default 16)
# with their products and TFLOP/s (python -m bench.gpu_profile --shapes), then python -m
# bench.conv_tiles over it with POLICIES (default: planner 128x128:264 128x64:264 64x128:264).
# Carry .gl, .whl and .glsl as for bench/gpu_run.sh. Output under $OUT. Environment: TOP (30),
# ROUNDS (2), RUNS (20).
source bench/gpu_daemon_env.sh
cd /tmp
python3 -c "from pathlib import Path; from bench.export_models import ensure; ensure('resnet50', Path('/tmp/models'), ${BATCH:-16})"
model=/tmp/models/resnet50-b${BATCH:-16}.onnx
timeout 200 python3 -m bench.gpu_profile $model --device vk0 --shapes --top ${TOP:-30} 2>&1 | tee "$OUT/profile.md"
timeout 300 python3 -m bench.conv_tiles $model --device vk0 --rounds ${ROUNDS:-2} --runs ${RUNS:-20} \
  --policies ${POLICIES:-planner 128x128:264 128x64:264 64x128:264} 2>&1 | tee "$OUT/conv-tiles.md"

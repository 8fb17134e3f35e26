#!/usr/bin/env bash
# On the GPU machine, in one call: python -m bench.conv_tiles over ResNet-50 exported at a batch of
# BATCH (default 16) and of 1, and the other MODELS at batch 1 (default unet mobilenetv2), with
# POLICIES (default: planner 128x128:264 128x128:132 128x64:264 64x128:264). Carry .gl, .whl and
# .glsl as for bench/gpu_run.sh. Output under $OUT. Environment: ROUNDS (2), RUNS (20).
source bench/gpu_daemon_env.sh
cd /tmp
python3 - <<PY
from pathlib import Path
from bench.export_models import ensure
for name, batch in [("resnet50", ${BATCH:-16}), ("resnet50", 1), *((m, 1) for m in "${MODELS-unet mobilenetv2}".split())]:
    ensure(name, Path("/tmp/models"), batch)
PY
models="/tmp/models/resnet50-b${BATCH:-16}.onnx /tmp/models/resnet50.onnx"
for m in ${MODELS-unet mobilenetv2}; do models="$models /tmp/models/$m.onnx"; done
timeout 540 python3 -m bench.conv_tiles $models --device vk0 --rounds ${ROUNDS:-2} --runs ${RUNS:-20} \
  --policies ${POLICIES:-planner 128x128:264 128x128:132 128x64:264 64x128:264} 2>&1 | tee "$OUT/conv-tiles.md"

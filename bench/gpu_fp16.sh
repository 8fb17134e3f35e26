#!/usr/bin/env bash
# On the GPU machine, in one call: the float16 transformers (BERT-base and GPT-2 small of
# bench.real_models, exported in float16 by bench.fp16_models) checked and timed beside torch's
# float16 CUDA graph in the same run, then where vkpool's time goes. Results under $OUT:
#   tests.txt           tests/test_fp16_*.py on the GPU (the cooperative-matrix paths run here)
#   real-models.txt/.json  python -m bench.real_models --half: vkpool against torch's float16 CUDA graph,
#                       batch 1, 128 tokens; errors against torch's float16 output and the float32 reference
#   gpu-profile.txt     GPU timestamps per dispatch of each float16 model (bench.gpu_profile)
#   gemm-skinny.txt/.json  bench.gemm_fp16 on the products of those models (128 rows), every tile of TILES
# Carry .gl, .whl, .glsl (see bench/gpu_run.sh). Usage: [SKIP="tests gemm profile"] bash bench/gpu_fp16.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash bench/gpu_run.sh fp16 "" --devices-only > "$OUT/setup.txt" 2>&1 || { cat "$OUT/setup.txt"; exit 1; }
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export VK_DRIVER_FILES=$icd VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench tests /tmp/benchpkg/
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
SKIP=${SKIP:-}
TILES=${TILES:-128x256x32_w2x4_p2_z8,128x128x32_w2x2_p2_z8,64x64x32_w2x2_p1_z8,64x64x64_w2x2_p1_z8,32x128x32_w1x4_p1_z8,64x32x32_w2x1_p1_z8,32x64x32_w1x2_p1_z8,32x64x64_w1x2_p2_z8,32x32x32_w1x1_p1_z8}
cd /tmp
cat "$OUT/devices-fp16.txt" 2>/dev/null | head -8
if [[ " $SKIP " != *" tests "* ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs /tmp/benchpkg/tests/test_fp16_*.py 2>&1 | tail -25 \
    | tee "$OUT/tests.txt"
fi
timeout 300 python3 -m bench.real_models --half --models bert gpt2 --runtimes vkpool torch_cudagraph \
  --models-dir /tmp/models --device vk0 --runs 100 --out "$OUT/real-models.json" 2>&1 | tee "$OUT/real-models.txt"
if [[ " $SKIP " != *" profile "* ]]; then
  for m in bert gpt2; do
    timeout 120 python3 -m bench.gpu_profile /tmp/models/$m-fp16.onnx --device vk0 --top 25
  done 2>&1 | tee "$OUT/gpu-profile.txt"
fi
if [[ " $SKIP " != *" gemm "* ]]; then
  timeout 200 python3 -m bench.gemm_fp16 --sizes --shapes 128x768x768 128x2304x768 128x3072x768 128x768x3072 \
    128x50257x768 --variants "$TILES" --json "$OUT/gemm-skinny.json" > "$OUT/gemm-skinny.txt" 2>&1
  grep -v "^  tile .*{" "$OUT/gemm-skinny.txt"
fi

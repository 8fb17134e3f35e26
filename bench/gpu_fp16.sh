#!/usr/bin/env bash
# On the GPU machine, in one call: the float16 transformers (BERT-base and GPT-2 small of
# bench.real_models, exported in float16 by bench.fp16_models) checked and timed beside torch's
# float16 CUDA graph in the same run, then where vkpool's time goes. Results under $OUT:
#   real-models.txt/.json  python -m bench.real_models --half: vkpool against torch's float16 CUDA graph,
#                       batch 1, 128 tokens; errors against torch's float16 output and the float32 reference
#   gpu-profile.txt     GPU timestamps per dispatch of each float16 model (bench.gpu_profile)
#   policies.txt        bench.fp16_policies: both models under other product tiles and K splits
#   real-models-fp32.txt/.json  the float32 models (vkpool and torch's CUDA graph): the float32 path's guard
#   tests.txt           tests/test_fp16_*.py on the GPU (the cooperative-matrix paths run here)
#   gemm-skinny.txt/.json  bench.gemm_fp16 on the products of those models (128 rows), tiles x K splits
# TOP (dispatches the profile lists, default 12), SHAPES and VARIANTS (bench.gemm_fp16's) and POLICIES
# (bench.fp16_policies') override
# the defaults. With BASE (a folder of the checkout holding another tree: `git archive <commit> |
# tar -x -C .base`; carry it too), that tree's vkpool runs the headline after this one's, then
# this one's again (real-models-base.*, real-models-again.*). Each step after the first is skipped once the call has run for BUDGET seconds (default 360), so
# that the whole stays under 8 minutes.
# Carry .gl, .whl, .glsl (see bench/gpu_run.sh). Usage: bash bench/gpu_fp16.sh [STEP ...]: the steps
# named are skipped (profile policies fp32 tests gemm; or SKIP="...")
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-360}
bash bench/gpu_run.sh fp16 "" --devices-only > "$OUT/setup.txt" 2>&1 || { cat "$OUT/setup.txt"; exit 1; }
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export VK_DRIVER_FILES=$icd VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench tests /tmp/benchpkg/
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
SKIP=${SKIP:-$*}
step() {  # step NAME: whether NAME runs (not skipped, time left)
  [[ " $SKIP " != *" $1 "* ]] && (( SECONDS < BUDGET )) || { echo "== $1 skipped (SKIP or ${SECONDS} s of $BUDGET used)"; return 1; }
}
cd /tmp
head -8 "$OUT/devices-fp16.txt" 2>/dev/null
timeout 240 python3 -m bench.real_models --half --models bert gpt2 --runtimes vkpool torch_cudagraph \
  --models-dir /tmp/models --device vk0 --runs 100 --out "$OUT/real-models.json" 2>&1 | tee "$OUT/real-models.txt"
if [ -n "${BASE:-}" ]; then  # another tree's vkpool, timed in the same call (then this one again)
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/vkpool-base \
    "$OLDPWD/$BASE" > /dev/null || exit 1
  PYTHONPATH=/tmp/site:/tmp/vkpool-base:/tmp/benchpkg timeout 200 python3 -m bench.real_models --half \
    --models bert gpt2 --runtimes vkpool --models-dir /tmp/models --device vk0 --runs 100 \
    --out "$OUT/real-models-base.json" 2>&1 | tee "$OUT/real-models-base.txt"
  timeout 200 python3 -m bench.real_models --half --models bert gpt2 --runtimes vkpool --models-dir /tmp/models \
    --device vk0 --runs 100 --out "$OUT/real-models-again.json" 2>&1 | tee "$OUT/real-models-again.txt"
fi
if step profile; then
  for m in bert gpt2; do
    timeout 60 python3 -m bench.gpu_profile /tmp/models/$m-fp16.onnx --device vk0 --top ${TOP:-12}
  done 2>&1 | tee "$OUT/gpu-profile.txt"
fi
if step policies; then
  timeout $(( BUDGET + 60 - SECONDS )) python3 -m bench.fp16_policies /tmp/models/bert-fp16.onnx \
    /tmp/models/gpt2-fp16.onnx --device vk0 --runs 50 ${POLICIES:+--policies $POLICIES} 2>&1 | tee "$OUT/policies.txt"
fi
if step fp32; then
  timeout 200 python3 -m bench.real_models --models bert gpt2 --runtimes vkpool torch_cudagraph \
    --models-dir /tmp/models --device vk0 --runs 100 --out "$OUT/real-models-fp32.json" 2>&1 \
    | tee "$OUT/real-models-fp32.txt"
fi
if step tests; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rfs --tb=short /tmp/benchpkg/tests/test_fp16_*.py \
    > "$OUT/tests.txt" 2>&1
  grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/tests.txt"
fi
if step gemm; then
  V=64x64x32_w2x2_p1_z8
  W=64x64x64_w2x2_p1_z8
  N=32x64x64_w1x2_p2_z8
  timeout 120 python3 -m bench.gemm_fp16 --sizes --shapes ${SHAPES:-128x768x768 128x2304x768 128x3072x768 128x768x3072} \
    --variants "${VARIANTS:-$V,$V/s3,$W,$W/s3,$N,$N/s3,$V/s6,$W/s6,$W/s12,$N/s12}" --json "$OUT/gemm-skinny.json" \
    > "$OUT/gemm-skinny.txt" 2>&1
  grep -v " tile .*: {" "$OUT/gemm-skinny.txt"
fi

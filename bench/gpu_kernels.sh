#!/usr/bin/env bash
# The kernel sweeps behind docs/benchmarks.md's GEMM and GEMV rows, in one call on the GPU machine,
# after `bash bench/gpu_run.sh x none --devices-only` (set-up; see that file for what to carry).
# Run from the checkout; results go to $OUT (default /tmp/out):
#   gemm-fp16.txt/.json   tests/test_fp16_gemm.py, then bench.gemm_fp16 over GEMM_TILES (default: its candidate
#                         list) at 8192 and 4096
#   gemv-16layers.txt     bench.gemv_probe: 16 chained 64 MiB GEMVs (matmul_1GB_16layers' shape), each split
#   gemv-1layer.txt       bench.gemv_probe: one 1 GiB GEMV + Softmax (matmul_1GB_1layer's shape), each split
#   matmul-harness-*.md  python -m bench on both matmul workloads, vkpool against torch's CUDA graph
# Environment: GEMM_TILES (CoopTile names), SKIP (words among gemm gemv harness).
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=python3
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
export VK_DRIVER_FILES=${VK_DRIVER_FILES:-/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json}
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
cp -r tests /tmp/benchpkg/ 2>/dev/null
SKIP=${SKIP:-}
TILES=${GEMM_TILES:-all}
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null
cd /tmp
if [[ " $SKIP " != *" gemm "* ]]; then
  { timeout 120 $PY -m pytest -q -p no:cacheprovider /tmp/benchpkg/tests/test_fp16_gemm.py 2>&1 | tail -3
    timeout 240 $PY -m bench.gemm_fp16 --sizes 8192 4096 --variants "$TILES" --json "$OUT/gemm-fp16.json"
  } > "$OUT/gemm-fp16.txt" 2>&1
  tail -30 "$OUT/gemm-fp16.txt"
fi
if [[ " $SKIP " != *" gemv "* ]]; then
  timeout 200 $PY -m bench.gemv_probe --sizes 4096 --layers 16 --variants --runs 200 \
    > "$OUT/gemv-16layers.txt" 2>&1; cat "$OUT/gemv-16layers.txt"
  timeout 200 $PY -m bench.gemv_probe --sizes 16384 --softmax --variants --runs 100 \
    > "$OUT/gemv-1layer.txt" 2>&1; cat "$OUT/gemv-1layer.txt"
fi
if [[ " $SKIP " != *" harness "* ]]; then
  timeout 300 $PY -m bench --workloads matmul_1GB_16layers matmul_1GB_1layer --runtimes vkpool torch_cudagraph \
    --out /tmp/harness-out 2>&1 | tail -20
  for f in /tmp/harness-out/*.md; do cp "$f" "$OUT/matmul-harness-$(basename "$f")"; done
fi

#!/usr/bin/env bash
# Runs on the GPU machine (one call does set-up, checks and timing); writes results under $OUT.
# Carry: .gl (libvulkan1 and glvnd .debs), .whl (vulkan, cffi, pycparser, pyzmq wheels), .glsl/glslang.tar.xz
# (glslangValidator and its shared libraries out of the cmeel wheels, 3 MB instead of 28 MB, so that
# everything fits the transfer limit), and for a mixed NVIDIA + llvmpipe pool .lvp/lvp.tar.xz (Mesa's
# lavapipe and its libraries). Make .glsl here with:
#   (cd .venv/lib/python3*/site-packages && tar cJf - cmeel.prefix/bin/glslangValidator \
#      cmeel.prefix/lib/libglslang.so.13 cmeel.prefix/lib/libSPIRV.so.13 \
#      cmeel.prefix/lib/libglslang-default-resource-limits.so.13 cmeel.prefix/lib/libSPIRV-Tools-shared.so) \
#      > .glsl/glslang.tar.xz
# Usage: bash bench/gpu_run.sh [name] [--lvp] [--devices-only]  (name labels the output files)
# Environment: WORKLOADS (default: all), PROFILE (workloads to time per dispatch), BENCH (arguments
# for python -m bench), BENCH_TIMEOUT.
set -uo pipefail
name=${1:-gpu}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
PY=python3
# Installs compile bytecode, as pip does by default: the machine sets PYTHONDONTWRITEBYTECODE, so
# without .pyc files every start would compile numpy's and vulkan's sources (0.5 s, 40 MiB).
$PY -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
$PY -m compileall -q -j 0 "$($PY -c 'import numpy, os; print(os.path.dirname(numpy.__file__))')" \
  "$($PY -c 'import onnx, os; print(os.path.dirname(onnx.__file__))')" > /dev/null 2>&1
[ -f .glsl/glslang.tar.xz ] && tar xJf .glsl/glslang.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:/tmp/vkpool-src
$PY -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/vkpool-src . >/dev/null || exit 1
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$icd" ] || icd=$(ls /usr/share/vulkan/icd.d/nvidia*.json /etc/vulkan/icd.d/nvidia*.json /usr/local/nvidia/share/vulkan/icd.d/*.json 2>/dev/null | head -1)
echo "NVIDIA ICD: $icd"; cat "$icd" 2>/dev/null | head -5
export VK_DRIVER_FILES=$icd
if [ "${2:-}" = "--lvp" ] && [ -f .lvp/lvp.tar.xz ]; then
  mkdir -p /tmp/lvp && tar xJf .lvp/lvp.tar.xz -C /tmp/lvp
  printf '{"file_format_version":"1.0.0","ICD":{"library_path":"/tmp/lvp/lib/libvulkan_lvp.so","api_version":"1.3.230"}}' > /tmp/lvp/lvp_icd.json
  export LD_LIBRARY_PATH=/tmp/lvp/lib VK_DRIVER_FILES=$icd:/tmp/lvp/lvp_icd.json
fi
export VKPOOL_CACHE_DIR=/tmp/vkcache PYTHONUNBUFFERED=1
cd /tmp  # run from outside the checkout so the installed package is what runs
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/nvidia-smi-$name.txt"
$PY -m vkpool devices --json > "$OUT/devices-$name.json" && $PY -m vkpool devices | tee "$OUT/devices-$name.txt"
[ "${3:-}" = "--devices-only" ] && exit 0
# Every workload on the GPU, checked against onnxruntime (CPU), with latency (BENCHMARKS.md protocol).
REPO=$OLDPWD
# the harness lives in the checkout; run a copy so the checkout's vkpool/ never shadows the installed one
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r "$REPO/bench" /tmp/benchpkg/
export PYTHONPATH=$PYTHONPATH:/tmp/benchpkg
$PY -m bench.workloads --out /tmp/models > /dev/null
for w in ${WORKLOADS:-mnist12_like mlp conv_few_15MB conv_many_255MB matmul_1GB_16layers matmul_1GB_1layer add_chain_1 add_chain_1000}; do
  [ -f /tmp/models/$w.onnx ] || $PY -m bench.workloads --out /tmp/models $w > /dev/null
  echo "== $w"; timeout 240 $PY -m vkpool run /tmp/models/$w.onnx --device vk0 --check --repeat 100
done 2>&1 | tee "$OUT/workloads-$name.txt"
for w in mnist12_like add_chain_1000; do
  timeout 120 $PY -m bench.where_time_goes /tmp/models/$w.onnx --device vk0
done 2>&1 | tee "$OUT/where-time-goes-$name.txt"
# GPU timestamps per dispatch (PROFILE lists the workloads to profile)
for w in ${PROFILE:-}; do
  [ -f /tmp/models/$w.onnx ] || $PY -m bench.workloads --out /tmp/models $w > /dev/null
  timeout 180 $PY -m bench.gpu_profile /tmp/models/$w.onnx --device vk0
done 2>&1 | tee "$OUT/gpu-profile-$name.txt"
if [ -n "${BENCH:-}" ]; then
  cd /tmp && timeout "${BENCH_TIMEOUT:-300}" $PY -m bench $BENCH --out /tmp/bench-out 2>&1 | tail -40
  cp /tmp/bench-out/*.md /tmp/bench-out/*.json "$OUT/" 2>/dev/null
fi

#!/usr/bin/env bash
# On a GPU machine with two GPUs: bench.cluster --gpus (two Ray nodes of one GPU each on this host:
# replicas and a two-stage split against one node, and a cross-node hop per MiB), output under $OUT.
# Carry .gl, .whl, .glsl and .ray: Ray for Python 3.12 without what vkpool does not use (its jars,
# dashboard client build, rllib, tune, train, data, llm; 28 MB instead of 79) plus the jsonschema
# wheels Ray needs that the machine lacks. Make .ray here with:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d /tmp/r ray==2.60.0 && mkdir -p /tmp/r/x && cd /tmp/r/x && \
#   unzip -q ../ray-*.whl && rm -rf ray/jars ray/rllib ray/dashboard/client/build ray/llm ray/tune \
#     ray/train ray/data && tar cJf .ray/ray_min.tar.xz .   (and pip download jsonschema
#   jsonschema-specifications referencing rpds-py for 3.12 into .ray)
# With BASE (a folder of the checkout holding another tree: `git archive <commit> | tar -x -C .base`;
# carry it too), that tree's vkpool and its bench.cluster run the same arguments after this one's
# (cluster-gpus-base.txt), so two trees compare on one warm host.
# Usage: [BASE=.base] bash bench/gpu_cluster.sh [bench.cluster arguments]
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash bench/gpu_run.sh cluster "" --devices-only || exit 1
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .ray/*.whl || exit 1
tar xJf .ray/ray_min.tar.xz -C /tmp/site || exit 1
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json VKPOOL_CACHE_DIR=/tmp/vkcache
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
rm -rf /tmp/benchpkg && mkdir -p /tmp/benchpkg && cp -r bench /tmp/benchpkg/
if [ -n "${BASE:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --upgrade --target /tmp/vkpool-base \
    "$BASE" > /dev/null || exit 1
  rm -rf /tmp/basebench && mkdir -p /tmp/basebench && cp -r "$BASE/bench" /tmp/basebench/
fi
cd /tmp
export PYTHONPATH=/tmp/site:/tmp/vkpool-src:/tmp/benchpkg
python3 -c "import ray; print('ray', ray.__version__)" || exit 1
timeout 500 python3 -m bench.cluster --gpus "$@" 2>&1 | tee "$OUT/cluster-gpus.txt"
if [ -n "${BASE:-}" ]; then
  PYTHONPATH=/tmp/site:/tmp/vkpool-base:/tmp/basebench timeout 500 python3 -m bench.cluster --gpus "$@" 2>&1 \
    | tee "$OUT/cluster-gpus-base.txt"
fi

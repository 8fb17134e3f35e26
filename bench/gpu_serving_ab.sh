#!/usr/bin/env bash
# The serving figures of two trees on one machine in one call: bench/gpu_serving.sh in this checkout
# (output under $OUT/cur), then in the tree $BASE (say `git archive` of the commit before a change;
# output under $OUT/base), each installed in turn. Carry .gl .whl .glsl and $BASE. Environment as
# for gpu_serving.sh, plus BASE_ONLY: the runs made for the base (default: those of ONLY). The runs
# are this checkout's gpu_serving.sh in both trees, so both make the same runs.
set -uo pipefail
OUT=${OUT:-/tmp/out}
top=$(pwd)
mkdir -p "$OUT/cur" "$OUT/base"
OUT=$OUT/cur bash bench/gpu_serving.sh
if [ -n "${BASE:-}" ]; then
  cd "$BASE" || exit 1
  for d in .gl .whl .glsl; do [ -e $d ] || ln -s "$top/$d" $d; done
  VKPOOL_GPU_READY= OUT=$OUT/base ONLY="${BASE_ONLY:-${ONLY:-}}" PROFILES=0 bash "$top/bench/gpu_serving.sh"
fi

#!/usr/bin/env bash
# On the GPU machine: this tree against BASE (a `git archive` of another commit, carried), ROUNDS
# alternating rounds of `python -m bench.conv_tiles --policies planner` (host median and GPU time
# of a run) over ResNet-50 at batch BATCH (default 16) and MODELS at batch 1 (default resnet50
# unet mobilenetv2 bert gpt2), then this tree's errors against onnxruntime CPU
# (`python -m bench.real_models --runtimes vkpool`), ResNet-50 at batch BATCH among them. Carry .gl
# .whl .glsl and BASE. Output under $OUT.
set -uo pipefail
source bench/gpu_daemon_env.sh > /dev/null
install_base
models=${MODELS-resnet50 unet mobilenetv2 bert gpt2}
(cd /tmp && python3 - <<PY
from pathlib import Path
from bench.export_models import ensure
for name, batch in [("resnet50", ${BATCH:-16}), *((m, 1) for m in "$models".split())]:
    ensure(name, Path("/tmp/models"), batch)
PY
)
paths="/tmp/models/resnet50-b${BATCH:-16}.onnx"
for m in $models; do paths="$paths /tmp/models/$m.onnx"; done
for r in $(seq 1 "${ROUNDS:-2}"); do
  for tree in cur base; do
    src=/tmp/vkpool-src; [ $tree = base ] && src=/tmp/vkpool-base
    echo "=== round $r, $tree"
    (cd /tmp && PYTHONPATH=/tmp/site:$src:/tmp/benchpkg timeout 300 python3 -m bench.conv_tiles $paths \
      --device vk0 --rounds 1 --runs ${RUNS:-20} --policies planner 2>&1 | grep -E "^/tmp|^\| planner|rror")
  done
done 2>&1 | tee "$OUT/tree-ab.md"
(cd /tmp && timeout 300 python3 -m bench.real_models --models $models --runtimes vkpool --runs 5 --warmup 2 \
  --device vk0 --models-dir /tmp/models --out "$OUT/errors.json" 2>&1 | grep -E "^\||rror") | tee -a "$OUT/tree-ab.md"
(cd /tmp && timeout 300 python3 -m bench.real_models --models resnet50 --batch ${BATCH:-16} --runtimes vkpool \
  --runs 5 --warmup 2 --device vk0 --models-dir /tmp/models --out "$OUT/errors-b${BATCH:-16}.json" 2>&1 \
  | grep -E "^\||rror") | tee -a "$OUT/tree-ab.md"

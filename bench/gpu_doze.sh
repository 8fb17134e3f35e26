#!/usr/bin/env bash
# On the GPU machine: one lane client's round trip for ResNet-50 (a run of about 1.2 ms) and
# mnist12_like, this tree against BASE (a `git archive` of another commit, carried), ROUNDS
# alternating rounds, with the daemon's default settings and with CONFIGS (daemon config files
# written here from "name:yaml" pairs, default inline5:inline_run_max 5ms). python -m
# bench.daemon_own_time. Carry .gl .whl .glsl and BASE. Output under $OUT.
set -uo pipefail
source bench/gpu_daemon_env.sh > /dev/null
install_base
printf 'daemon:\n  inline_run_max: 5ms\n' > /tmp/inline5.yaml
(cd /tmp && timeout 200 python3 -m bench.export_models --only resnet50 --batch-dim --out /tmp/models | tail -1
 python3 -m bench.workloads --out /tmp/models mnist12_like > /dev/null)
for r in $(seq 1 "${ROUNDS:-2}"); do
  for tree in cur ${BASE:+base}; do
    src=/tmp/vkpool-src; [ $tree = base ] && src=/tmp/vkpool-base
    for cfg in "" /tmp/inline5.yaml; do
      for m in resnet50-batch mnist12_like; do
        echo "=== round $r, $tree, $m${cfg:+, $cfg}"
        (cd /tmp && PYTHONPATH=/tmp/site:$src:/tmp/benchpkg timeout 120 python3 -m bench.daemon_own_time \
          /tmp/models/$m.onnx --runs ${RUNS:-300} ${cfg:+--config $cfg} 2>&1 | grep -E "^\| [a-z]|^counts|^threads|rror")
      done
    done
  done
done 2>&1 | tee "$OUT/doze.md"

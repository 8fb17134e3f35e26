#!/usr/bin/env bash
# On the GPU machine: the daemon's own work per request at one client over the lane
# (`python -m bench.daemon_own_time`, with the model's run and with it stubbed out), ROUNDS times,
# with how often the lanes' thread slept, the garbage collections and the busy threads of the
# daemon's process. With BASE (a `git archive` of another commit), the base tree runs after this
# one in every round. Carry .gl .whl .glsl (and BASE). Output under $OUT. Environment: ROUNDS
# (default 2), MODELS (default: mnist12_like add_chain_1), RUNS (default 3000), STUB ("no": the
# real runs alone), BASE, PIN (1: each also with --pin, threads held on CPUs of their own).
set -uo pipefail
source bench/gpu_daemon_env.sh > /dev/null
install_base
for w in ${MODELS:-mnist12_like add_chain_1}; do
  (cd /tmp && python3 -m bench.workloads --out /tmp/models $w > /dev/null)
done
for r in $(seq 1 "${ROUNDS:-2}"); do
  for tree in cur ${BASE:+base}; do
    src=/tmp/vkpool-src; [ $tree = base ] && src=/tmp/vkpool-base
    echo "=== round $r, $tree"
    for w in ${MODELS:-mnist12_like add_chain_1}; do
      for stub in "" $([ "${STUB:-}" = no ] || echo --stub-run); do
        for pin in "" $([ "${PIN:-0}" = 1 ] && echo --pin); do
          (cd /tmp && PYTHONPATH=/tmp/site:$src:/tmp/benchpkg timeout 120 python3 -m bench.daemon_own_time \
            /tmp/models/$w.onnx --runs "${RUNS:-3000}" $stub $pin 2>&1 | grep -E "^\| [a-z]|^counts|^garbage|^threads|rror")
        done
      done
    done
  done
done 2>&1 | tee "$OUT/daemon-own.md"

#!/usr/bin/env bash
# Where one client's round trip through the daemon goes on the GPU machine: `python -m
# bench.round_trip_split` (client before / waiting / after, the daemon's own time) and `python -m
# bench.daemon_own_time --stub-run` (the daemon's own work per request, the model's run left out),
# ROUNDS times, with the CPU named. With BASE (a `git archive` of another commit) the base tree runs
# after this one in every round. Carry .gl .whl .glsl (and BASE). Output under $OUT.
# Environment: ROUNDS (default 3), MODELS (default: mnist12_like add_chain_1), RUNS (default 3000),
# TRANSPORTS (default: lane zmq), BASE, ORDER (default "cur base": the trees in each round, in order).
set -uo pipefail
source bench/gpu_daemon_env.sh > /dev/null
lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz" | tee "$OUT/cpu.txt"
python3 -m timeit -s "def f(a, b): return a" "f(1, 2)" | tee -a "$OUT/cpu.txt"
install_base
models=
for w in ${MODELS:-mnist12_like add_chain_1}; do
  (cd /tmp && python3 -m bench.workloads --out /tmp/models $w > /dev/null)
  models="$models /tmp/models/$w.onnx"
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  for tree in ${ORDER:-cur ${BASE:+base}}; do
    src=/tmp/vkpool-src; [ $tree = base ] && src=/tmp/vkpool-base
    echo "=== round $r, $tree"
    (cd /tmp && PYTHONPATH=/tmp/site:$src:/tmp/benchpkg timeout 200 python3 -m bench.round_trip_split $models \
      --runs "${RUNS:-3000}" --transport ${TRANSPORTS:-lane zmq} 2>&1 | grep -E "^\| [a-z]|rror")
    for m in $models; do
      (cd /tmp && PYTHONPATH=/tmp/site:$src:/tmp/benchpkg timeout 120 python3 -m bench.daemon_own_time $m \
        --runs "${RUNS:-3000}" --stub-run 2>&1 | grep -E "^\| [a-z]|rror")
    done
  done
done 2>&1 | tee "$OUT/round-trip-split.md"
# SERVING: jobs/s at 1, 16 and 64 clients over the lane, fixed batch and --max-batch 32, both trees
if [ -n "${SERVING:-}" ]; then
  for r in $(seq 1 "${SERVING_ROUNDS:-2}"); do
    for tree in ${ORDER:-cur ${BASE:+base}}; do
      src=/tmp/vkpool-src; [ $tree = base ] && src=/tmp/vkpool-base
      for batch in "" "--max-batch 32"; do
        echo "=== serving round $r, $tree ${batch:-fixed}"
        (cd /tmp && PYTHONPATH=/tmp/site:$src:/tmp/benchpkg timeout 150 python3 -m vkpool.daemon.bench mnist12_like \
          --runs 300 --seconds 2 --clients 1 16 64 --transport lane $batch 2>&1 | grep -E "^\| mnist|rror")
      done
    done
  done 2>&1 | tee "$OUT/serving.md"
fi

#!/usr/bin/env bash
# One ZeroMQ client's round trip through the daemon, leg by leg (`python -m bench.zmq_timeline`),
# ROUNDS times, on the GPU machine; then `python -m bench.zmq_floor` once for the transport's own
# legs. Carry .gl .whl .glsl. Output under $OUT. Environment: ROUNDS (3), MODELS (mnist12_like),
# RUNS (3000), ARGS (more arguments, e.g. --stub-run), ENVS (variants: "name:VAR=value,VAR=value ..."; each round runs them in turn after the tree as it is).
set -uo pipefail
source bench/gpu_daemon_env.sh > /dev/null
models=
for w in ${MODELS:-mnist12_like}; do
  (cd /tmp && python3 -m bench.workloads --out /tmp/models $w > /dev/null)
  models="$models /tmp/models/$w.onnx"
done
for r in $(seq 1 "${ROUNDS:-3}"); do
  for variant in "as-is:" ${ENVS:-}; do
    name=${variant%%:*}; vars=${variant#*:}
    for m in $models; do
      echo "=== round $r, $name"
      (cd /tmp && env ${vars//,/ } timeout 200 python3 -m bench.zmq_timeline $m --runs "${RUNS:-3000}" ${ARGS:-} 2>&1 | tail -5)
    done
  done
done 2>&1 | tee "$OUT/zmq-timeline.md"
(cd /tmp && timeout 100 python3 -m bench.zmq_floor --runs 3000 --work-us 50 --pin none 2>&1 | tail -4) | tee -a "$OUT/zmq-timeline.md"

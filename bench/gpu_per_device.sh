#!/usr/bin/env bash
# On a machine with two GPUs, in one call: jobs/s of mnist12_like served from one GPU, replicated
# on both by one daemon process (`--objective throughput`), and by a daemon with a serving process
# per GPU (`daemon.process_per_device`), over the local lane with 1, 16 and 64 client processes,
# fixed batch and with dynamic batching, in ROUNDS alternating rounds (python -m vkpool.daemon.bench).
# Carry .gl, .whl and .glsl as for bench/gpu_run.sh. Output under $OUT: one JSON per run and
# rounds.md. Environment: ROUNDS (default 2), CLIENTS (default "1 16 64"), SECONDS_EACH (2),
# MAX_BATCH (32), ONLY (the variants, in order, of one replicas perdev perdev3 perdev4 [run_slots 3
# or 4], all [every GPU, one daemon process, the planner's placement] and split2 split3 [GPU 0
# shown as 2 or 3 members, a serving process for each: that many processes serving one GPU; on a
# machine of one GPU too]; default "one replicas perdev"), MODES (of fixed batched; default both).
set -uo pipefail
source bench/gpu_daemon_env.sh
(cd /tmp && python3 -m vkpool devices | head -4)
printf 'devices:\n  - match: {index: 1}\n    exclude: true\nhost:\n  enabled: false\n' > /tmp/one.yaml
printf 'host:\n  enabled: false\n' > /tmp/two.yaml
printf 'host:\n  enabled: false\ndaemon:\n  process_per_device: true\n' > /tmp/perdev.yaml
for n in 2 3; do  # splitN: GPU 0 as N members, each served by a process of its own
  printf "devices:\n  - match: {index: 0}\n    split: $n\nhost:\n  enabled: false\ndaemon:\n  process_per_device: true\n" > /tmp/split$n.yaml
done
for n in 3 4; do  # perdevN: a serving process per GPU, each model keeping N runs in flight
  printf "host:\n  enabled: false\ndaemon:\n  process_per_device: true\n  run_slots: $n\n" > /tmp/perdev$n.yaml
done
clients=${CLIENTS:-1 16 64}
for r in $(seq 1 "${ROUNDS:-2}"); do
  for variant in ${ONLY:-one replicas perdev}; do
    case $variant in
      one) opts="--config /tmp/one.yaml" ;;
      replicas) opts="--config /tmp/two.yaml --objective throughput" ;;
      all) opts="--config /tmp/two.yaml" ;;
      split*|perdev*) opts="--config /tmp/$variant.yaml" ;;
    esac
    for mode in ${MODES:-fixed batched}; do
      batch=; [ $mode = batched ] && batch="--max-batch ${MAX_BATCH:-32}"
      name=$variant-$mode-$r
      echo "=== round $r, $name"
      (cd /tmp && timeout 170 python3 -m vkpool.daemon.bench mnist12_like --runs 100 --clients $clients \
        --transport lane --seconds ${SECONDS_EACH:-2} $opts $batch --out "$OUT/$name.json" 2>&1 \
        | grep -E "^\| mnist|Error|error")
    done
  done
done 2>&1 | tee "$OUT/rounds.md"

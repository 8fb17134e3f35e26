#!/usr/bin/env bash
# On a GPU machine with two GPUs, the serving figures of one daemon in one call: jobs/s over the
# local lane and ZeroMQ with 1, 4, 16 and 64 client processes (python -m vkpool.daemon.bench),
# fixed batch and dynamic batching, the model on one GPU and replicated on both, ResNet-50 exported
# with a symbolic batch (fixed and batched; RESNET_BATCH, default 16; batched-d: with a queue delay,
# RESNET_DELAY_US, default 2000), then py-spy
# samples of the daemon under 16 clients, fixed batch and batching (all threads).
# Carry .gl, .whl (with py-spy) and .glsl as for bench/gpu_run.sh. Output under $OUT.
# Environment: CLIENTS, SECONDS_EACH, MAX_BATCH, DELAYS_US (queue delays, in µs, each a batched run
# of its own, batched-dN), PROFILES (0: no py-spy samples), ONLY (the runs to make, of fixed batched
# batched-dN resnet50-fixed resnet50-batched resnet50-batched-d replicas-fixed replicas-batched; default all), CONFIG
# (the daemon's config file, passed to every run).
source bench/gpu_daemon_env.sh
(cd /tmp && python3 -m vkpool devices | head -4)
clients=${CLIENTS:-1 4 16 64}
secs=${SECONDS_EACH:-2}
run() {  # name, then bench arguments
  local name=$1; shift
  [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]] && return 0
  echo "=== $name: $*"
  (cd /tmp && timeout 170 python3 -m vkpool.daemon.bench "$@" --seconds $secs ${CONFIG:+--config $CONFIG} \
    --out "$OUT/$name.json" 2>&1 | grep -E "^\| |^CPU|Error|error")
}
run fixed mnist12_like add_chain_1 --runs 300 --clients $clients --transport both
run batched mnist12_like --runs 300 --clients $clients --transport lane --max-batch ${MAX_BATCH:-32}
for us in ${DELAYS_US:-}; do  # batching with a queue delay: the first request waits for company
  run batched-d$us mnist12_like --runs 100 --clients $clients --transport lane --max-batch ${MAX_BATCH:-32} \
    --max-delay-us $us
done
if [[ -z "${ONLY:-}" || " $ONLY " == *" resnet50-"* ]]; then  # ResNet-50 with a symbolic batch (torch exports it)
  (cd /tmp && timeout 200 python3 -m bench.export_models --only resnet50 --batch-dim --out /tmp/models | tail -1)
fi
run resnet50-fixed /tmp/models/resnet50-batch.onnx --runs 30 --clients 1 4 16 --transport lane
run resnet50-batched /tmp/models/resnet50-batch.onnx --runs 30 --clients 1 4 16 --transport lane \
  --max-batch ${RESNET_BATCH:-16}
run resnet50-batched-d /tmp/models/resnet50-batch.onnx --runs 30 --clients 1 4 16 --transport lane \
  --max-batch ${RESNET_BATCH:-16} --max-delay-us ${RESNET_DELAY_US:-2000}
run replicas-fixed mnist12_like --runs 100 --clients 1 16 64 --transport lane --objective throughput
run replicas-batched mnist12_like --runs 100 --clients 1 16 64 --transport lane --objective throughput \
  --max-batch ${MAX_BATCH:-32}
[ "${PROFILES:-1}" = 0 ] && exit 0
for batch in "" "--max-batch ${MAX_BATCH:-32}"; do
  name=$([ -n "$batch" ] && echo batched || echo fixed)
  echo "=== profile: 16 clients, $name, lane"
  mkdir -p /tmp/prof-$name
  (cd /tmp && timeout 90 python3 -m bench.daemon_profile mnist12_like --clients 16 --seconds 3 \
    --transport lane $batch --out /tmp/prof-$name 2>&1 | head -24)
  cp /tmp/prof-$name/daemon-profile.txt "$OUT/daemon-profile-$name.txt"
done

#!/usr/bin/env bash
# On the GPU machine: py-spy samples of the daemon (every thread) while N clients send bound infers
# of mnist12_like (batching up to 32) over the lane, for N in $CLIENTS (default "16 1"): the raw
# collapsed stacks and bench.daemon_profile's summary go to $OUT/pN/ and $OUT/pN.txt.
# Carry .gl, .whl (py-spy among the wheels) and .glsl as for bench/gpu_run.sh.
source bench/gpu_daemon_env.sh
cd /tmp
for c in ${CLIENTS:-16 1}; do
  timeout 120 python3 -m bench.daemon_profile ${MODEL:-mnist12_like} --clients "$c" --seconds 5 \
    --max-batch ${MAX_BATCH:-32} --transport lane --out "$OUT/p$c" > "$OUT/p$c.txt" 2>&1
done

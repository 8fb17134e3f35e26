#!/usr/bin/env bash
# On the GPU machine: how much a daemon's serving figures vary from one start to the next, and
# where its busy threads ran. STARTS times (default 6): `python -m vkpool.daemon.bench` (BENCH_ARGS,
# default mnist12_like batched, 1 and 16 clients), with the daemon's threads sampled meanwhile
# (`ps -L`: the CPU each ran on last and its share of one), and which CPUs take the GPU's
# interrupts. Carry .gl .whl .glsl. Output under $OUT (probe.md).
set -uo pipefail
source bench/gpu_daemon_env.sh > /dev/null
args=${BENCH_ARGS:-mnist12_like --runs 200 --clients 1 16 --transport lane --max-batch 32 --seconds 2}
grep -i nvidia /proc/interrupts | head -4 | cut -c1-200
for s in $(seq 1 "${STARTS:-6}"); do
  echo "=== start $s"
  (cd /tmp && timeout 170 python3 -m vkpool.daemon.bench $args --out "$OUT/start-$s.json" 2>&1 \
    | grep -E "^\| mnist|^\| add|^\| /|Error|error") &
  bench=$!
  for t in 1 2 3 4 5 6 7 8 9 10 11 12; do  # the daemon's threads over 1% of a CPU, every 2 s
    sleep 2
    pid=$(pgrep -f "vkpool.*serve --endpoint ipc:///tmp/vkb" | head -1)
    [ -n "$pid" ] && echo "t=$((2*t))s $(ps -L -o tid=,psr=,pcpu= -p $pid | awk '$3 > 1 {printf "%s@cpu%s:%s%% ", $1, $2, $3}')"
  done
  wait $bench
done 2>&1 | tee "$OUT/probe.md"
grep -i nvidia /proc/interrupts | head -4 | cut -c1-200

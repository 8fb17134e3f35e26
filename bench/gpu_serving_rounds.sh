#!/usr/bin/env bash
# Two trees' serving figures in alternating rounds on one machine, in one call: this checkout and
# $BASE (a `git archive` of another commit), each installed apart, then ROUNDS rounds of
# `python -m vkpool.daemon.bench` (BENCH_ARGS) for this tree then the base, so that the machine's
# drift between rounds falls on both alike. Carry .gl .whl .glsl and $BASE. Output under $OUT:
# cur-N.json, base-N.json and the tables (rounds.md).
# Environment: BASE, ROUNDS (default 3), BENCH_ARGS (default: mnist12_like batched, 1 16 64 clients),
# VARIANTS: more runs of this tree per round, each "name:VAR=value" (its environment), say
# "nodoze:VKPOOL_LANE_DOZE_US=0".
set -uo pipefail
source bench/gpu_daemon_env.sh > /dev/null
top=$(pwd)
install_base
args=${BENCH_ARGS:-mnist12_like --runs 300 --clients 1 16 64 --transport lane --max-batch 32 --seconds 2}
for r in $(seq 1 "${ROUNDS:-3}"); do
  for tree in cur ${VARIANTS:-} ${BASE:+base}; do
    src=/tmp/vkpool-src; [ $tree = base ] && src=/tmp/vkpool-base
    name=${tree%%:*}; vars=; [[ $tree == *:* ]] && vars=${tree#*:}
    echo "=== round $r, $name"
    (cd /tmp && env $vars PYTHONPATH=/tmp/site:$src:/tmp/benchpkg timeout 170 python3 -m vkpool.daemon.bench $args \
      --out "$OUT/$name-$r.json" 2>&1 | grep -E "^\| mnist|^\| add|^\| /|Error|error")
  done
done 2>&1 | tee "$OUT/rounds.md"
cd "$top"

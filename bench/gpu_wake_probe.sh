#!/usr/bin/env bash
# How long a sleeping thread takes to wake on the GPU machine, and what that costs the daemon's round
# trips: the machine's idle states, then `bench.zmq_floor` and `bench.round_trip_split` (mnist12_like,
# one client) with and without a PM QoS request for no CPU wake-up latency held open
# (/dev/cpu_dma_latency = 0, where the machine lets us write it). Carry .gl .whl .glsl. Output under $OUT.
set -uo pipefail
source bench/gpu_daemon_env.sh > /dev/null
{
  echo "uid $(id -u); virt: $(systemd-detect-virt 2>/dev/null || echo '?'); hypervisor flag: $(grep -c hypervisor /proc/cpuinfo)"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|MHz|Hypervisor"
  echo "cpuidle driver: $(cat /sys/devices/system/cpu/cpuidle/current_driver 2>&1); governor: $(cat /sys/devices/system/cpu/cpuidle/current_governor_ro 2>&1)"
  for s in /sys/devices/system/cpu/cpu0/cpuidle/state*; do
    [ -d "$s" ] && echo "  $(cat $s/name) latency $(cat $s/latency) us, usage $(cat $s/usage)"
  done
  cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1 | sed 's/^/cpufreq governor: /'
  ls -l /dev/cpu_dma_latency 2>&1
  cat /sys/module/haltpoll/parameters/* 2>/dev/null | head; ls /sys/module | grep -i -E "haltpoll|kvm" 
  cat /proc/cmdline
} 2>&1 | tee "$OUT/machine.txt"
(cd /tmp && python3 -m bench.workloads --out /tmp/models mnist12_like > /dev/null)
hold() {  # holds a PM QoS request of $1 µs for as long as the process lives
  python3 -c "
import os, struct, sys, time
fd = os.open('/dev/cpu_dma_latency', os.O_WRONLY)
os.write(fd, struct.pack('i', int(sys.argv[1])))
print('holding cpu_dma_latency', sys.argv[1], flush=True)
time.sleep(3600)" "$1" &
  HOLD=$!; sleep 1
}
for mode in plain qos0 plain qos0; do
  echo "=== $mode"
  HOLD=
  [ $mode = qos0 ] && hold 0
  (cd /tmp && timeout 120 python3 -m bench.zmq_floor --runs 3000)
  (cd /tmp && timeout 200 python3 -m bench.round_trip_split /tmp/models/mnist12_like.onnx --runs 2000 \
     --transport lane zmq 2>&1 | grep -E "^\| [a-z]|rror")
  [ -n "$HOLD" ] && kill $HOLD
done 2>&1 | tee "$OUT/wake.md"

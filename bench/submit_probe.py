"""What a submission round trip costs on this device as more device memory is allocated.

Usage: python -m bench.submit_probe [--device vk0] [--models matmul_1GB_1layer matmul_1GB_16layers] [--runs 200]

Records one command buffer holding only a host barrier and times submit + fence wait (median of
``--runs``) on an otherwise idle device, first with nothing loaded, then after loading each model
in turn (they stay loaded, so their allocations add up). A round trip that grows with what is
allocated points at per-submission work in the driver (residency of every allocation), which
GPU timestamps inside the command buffer cannot see.
"""
from __future__ import annotations

import argparse
from typing import Any

from bench import workloads
from bench.stats import median_run_s


def _round_trip_us(device: Any, runs: int) -> float:
    cmd = device.allocate_command_buffer()
    sub = device.submission(cmd)
    device.record(cmd, [("host_barrier",)])
    try:
        return median_run_s(lambda: (device.submit(sub), device.wait(sub)), runs) * 1e6
    finally:
        sub.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None)
    ap.add_argument("--models", nargs="+", default=["matmul_1GB_1layer", "matmul_1GB_16layers"])
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    from vkpool.pool import DevicePool
    from vkpool.session import Session

    pool = DevicePool.from_config(None)
    member = pool.member(args.device) if args.device else next(m for m in pool.members if m.kind == "vulkan")
    device = member.device
    print(f"{device.info.name}\n\n| loaded | device memory of sessions, MiB | empty submit + wait, µs |\n|---|---|---|")
    print(f"| nothing | 0 | {_round_trip_us(device, args.runs):.1f} |", flush=True)
    sessions, loaded = [], []
    for name in args.models:
        sessions.append(Session(workloads.build(name).SerializeToString(), pool=pool, device=member.id))
        loaded.append(name)
        mib = sum(sum(s.memory_by_member().values()) for s in sessions) / (1 << 20)
        print(f"| {' + '.join(loaded)} | {mib:.0f} | {_round_trip_us(device, args.runs):.1f} |", flush=True)
    for s in sessions:
        s.close()
    print(f"| nothing (closed again) | 0 | {_round_trip_us(device, args.runs):.1f} |")
    pool.close()


if __name__ == "__main__":
    main()

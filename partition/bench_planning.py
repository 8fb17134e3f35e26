"""Times planning a 2,000-op random graph on 4 members: ``python -m vkpool.partition.bench_planning``.

Prints the median wall time and the median CPU time of this process (the second is what a
machine shared with other jobs does not inflate). ``--distinct`` gives each member its own
speed, so the DP cannot collapse interchangeable members into a count.
"""
from __future__ import annotations

import argparse
import statistics
import time

from vkpool.partition.algorithms import dp_partition, greedy_partition
from vkpool.partition.cost import DEFAULT_COSTS, Member
from vkpool.partition.graph import random_dag
from vkpool.partition.plan import chunk_peak_bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--distinct", action="store_true", help="members of different speeds")
    args = parser.parse_args(argv)
    G = random_dag(args.ops, seed=1)
    # half the model's peak per member: no member holds it alone, so the DP must split
    budget = chunk_peak_bytes(G, G.graph["order"]) // 2
    base = DEFAULT_COSTS["vulkan"]
    members = [Member(f"gpu{k}", budget, base.with_overrides({"flops_per_s": base.flops_per_s * (1 + k / 4)})
                      if args.distinct else base) for k in range(args.members)]
    for label, run in [("dp latency", lambda: dp_partition(G, members, objective="latency")),
                       ("dp throughput", lambda: dp_partition(G, members, objective="throughput")),
                       ("greedy", lambda: greedy_partition(G, members))]:
        times, cpu = [], []
        for _ in range(args.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                plan = run()
                note = f"{len(plan.chunks)} chunks"
            except Exception as exc:  # greedy may find no first-fit plan: report, do not stop
                note = type(exc).__name__
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        print(f"{label:>14}: median {statistics.median(times):.2f} s wall, {statistics.median(cpu):.2f} s CPU "
              f"over {args.repeat} ({note}), {args.ops} ops, {args.members} members")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

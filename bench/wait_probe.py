"""How the host waits for a run: latency of ``Session.run`` per way of waiting for the fence.

Usage: python -m bench.wait_probe MODEL [MODEL ...] [--device vk0] [--runs 200]

MODEL is an ONNX file or a workload name (``mnist12_like``, ``matmul_1GB_16layers``, ...).

Ways compared: as shipped (poll for twice a run's usual time, between 0.2 and 5 ms, then block
in the driver); polling for up to 0.2 ms, then blocking; polling only (up to 5 ms); blocking in
the driver at once. Prints the median and p90 of each, in microseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench import workloads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device")
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    from vkpool import device as device_module
    from vkpool.cli import random_inputs
    from vkpool.session import Session

    shipped = device_module.LogicalDevice.wait
    ways = {
        "as shipped": shipped,
        "poll 0.2 ms, then block": lambda self, sub: shipped(self, sub, spin_seconds=0.0002),
        "poll only (5 ms)": lambda self, sub: shipped(self, sub, spin_seconds=0.005),
        "block at once": lambda self, sub: shipped(self, sub, spin_seconds=0.0),
    }
    print("| model | wait | median µs | p90 µs |\n|---|---|---|---|")
    for model in args.models:
        source = model if Path(model).exists() else workloads.build(model).SerializeToString()
        sess = Session(source, device=args.device)
        feeds = random_inputs(sess.get_inputs())
        for label, wait in ways.items():
            device_module.LogicalDevice.wait = wait
            try:
                for _ in range(20):
                    sess.run(None, feeds)
                times = []
                for _ in range(args.runs):
                    t0 = time.perf_counter()
                    sess.run(None, feeds)
                    times.append((time.perf_counter() - t0) * 1e6)
            finally:
                device_module.LogicalDevice.wait = shipped
            times.sort()
            print(f"| {Path(model).stem} | {label} | {statistics.median(times):.1f} | "
                  f"{times[int(0.9 * len(times))]:.1f} |", flush=True)
        sess.close()


if __name__ == "__main__":
    main()

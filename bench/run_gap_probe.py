"""Whether a run is slower when the host did something else for a while before it.

Usage: python -m bench.run_gap_probe MODEL.onnx ... [--gaps-us 0 10 25 50 100] [--runs 2000] [--rounds 2]

In the daemon a run follows the client's round trip (tens of microseconds in which the device
idles and the serving thread reads rings and writes replies), where an in-process loop runs back to
back. For each gap, this thread spins that long between ``Session.run`` calls (touching nothing)
and the median run is printed, the gaps in alternating rounds: a run that grows with the gap is
slowed by the device or the driver waking, not by the daemon's Python.
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.stats import spin


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device", default=None)
    ap.add_argument("--gaps-us", type=float, nargs="+", default=[0.0, 10.0, 25.0, 50.0, 100.0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    from vkpool import Session
    from vkpool.cli import random_inputs

    clock = time.perf_counter
    for path in args.models:
        with Session(path, device=args.device) as sess:
            feeds = random_inputs(sess.get_inputs())
            for _ in range(200):
                sess.run(None, feeds)
            medians: dict[float, list[float]] = {g: [] for g in args.gaps_us}
            for _ in range(args.rounds):
                for gap in args.gaps_us:
                    took = []
                    for _ in range(args.runs):
                        t0 = spin(gap * 1e-6)
                        sess.run(None, feeds)
                        took.append(clock() - t0)
                    medians[gap].append(statistics.median(took) * 1e6)
            print(f"{path} on {sess.member.id}: Session.run median µs after each gap, rounds in order")
            print("| gap before each run, µs | " + " | ".join(f"round {r + 1}" for r in range(args.rounds)) + " |")
            print("|---|" + "---|" * args.rounds)
            for gap, ms in medians.items():
                print(f"| {gap:g} | " + " | ".join(f"{m:.1f}" for m in ms) + " |", flush=True)


if __name__ == "__main__":
    main()

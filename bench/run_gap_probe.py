"""Whether a run is slower when the host did something else for a while before it.

Usage: python -m bench.run_gap_probe MODEL.onnx ... [--gaps-us 0 10 25 50 100] [--runs 2000] [--rounds 2]
                                   [--gap-work spin touch] [--touch-mib 8]

In the daemon a run follows the client's round trip (tens of microseconds in which the device
idles and the serving thread reads rings and writes replies), where an in-process loop runs back to
back. For each gap, this thread spins that long between ``Session.run`` calls (touching nothing)
and the median run is printed, the gaps in alternating rounds: a run that grows with the gap is
slowed by the device or the driver waking, not by the daemon's Python.

``--gap-work touch``: the gap is spent on Python work over ``--touch-mib`` of objects instead (each
gap goes on where the last one stopped), as the daemon's own work between two runs touches its
clients' rings, replies and books: a run that is slower after it than after the same gap spun
is slowed by the CPU's caches holding the other work's data instead of the run's.
"""
from __future__ import annotations

import argparse
import statistics
import time

from bench.stats import spin


class Toucher:
    """Python objects of about ``mib`` MiB in all, touched in turn (a count raised in each)."""

    def __init__(self, mib: float) -> None:
        # a dict with a short string and a small list: about 400 bytes with its members
        self.objects = [{"n": i, "s": f"{i:08d}", "l": [i, i]} for i in range(max(1, int(mib * 2**20 / 400)))]
        self.at = 0

    def touch(self, gap_s: float) -> float:
        """Touches the next objects for ``gap_s``; returns ``time.perf_counter()`` at its end."""
        clock, objects, at = time.perf_counter, self.objects, self.at
        n, until = len(objects), clock() + gap_s
        while (now := clock()) < until:
            for _ in range(16):
                objects[at]["n"] += 1
                at = at + 1 if at + 1 < n else 0
        self.at = at
        return now


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    ap.add_argument("--device", default=None)
    ap.add_argument("--gaps-us", type=float, nargs="+", default=[0.0, 10.0, 25.0, 50.0, 100.0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gap-work", nargs="+", choices=("spin", "touch"), default=["spin"])
    ap.add_argument("--touch-mib", type=float, default=8.0)
    args = ap.parse_args(argv)
    from vkpool import Session
    from vkpool.cli import random_inputs

    clock = time.perf_counter
    for path in args.models:
        with Session(path, device=args.device) as sess:
            feeds = random_inputs(sess.get_inputs())
            for _ in range(200):
                sess.run(None, feeds)
            kinds = [(gap, work) for gap in args.gaps_us for work in args.gap_work]
            medians: dict[tuple[float, str], list[float]] = {k: [] for k in kinds}
            toucher = Toucher(args.touch_mib)
            for _ in range(args.rounds):
                for gap, work in kinds:
                    wait = spin if work == "spin" else toucher.touch
                    took = []
                    for _ in range(args.runs):
                        t0 = wait(gap * 1e-6)
                        sess.run(None, feeds)
                        took.append(clock() - t0)
                    medians[(gap, work)].append(statistics.median(took) * 1e6)
            print(f"{path} on {sess.member.id}: Session.run median µs after each gap, rounds in order")
            rounds = " | ".join(f"round {r + 1}" for r in range(args.rounds))
            print(f"| gap before each run, µs | spent | {rounds} |")
            print("|---|---|" + "---|" * args.rounds)
            for (gap, work), ms in medians.items():
                spent = "spinning" if work == "spin" else f"touching {args.touch_mib:g} MiB"
                print(f"| {gap:g} | {spent} | " + " | ".join(f"{m:.1f}" for m in ms) + " |", flush=True)


if __name__ == "__main__":
    main()

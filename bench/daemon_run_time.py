"""Is a model's run slower inside the daemon than in a process of its own?

Usage: python -m bench.daemon_run_time MODEL.onnx [MODEL.onnx ...] [--runs 3000] [--config FILE]

For each model it alternates blocks of ``Session.run`` in this process with blocks of jobs
through a daemon (``vkpool serve`` on a temporary socket, the local lane), then reads the
daemon's own job latency (``status``: the median of its last 1000 jobs, from the request taken
off the lane to the reply packed, the run included) and prints, in µs at the median:
in-process run, the daemon's own time per job, the whole round trip through the daemon, and
what is left for the two transports and the client.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--config", default=None)
    args = ap.parse_args()
    from vkpool.daemon.bench import BenchDaemon, feeds_for
    from vkpool.session import Session

    daemon = BenchDaemon(args.config)
    try:
        with daemon.client(local_lane=True) as client:
            print("| model | in-process run | daemon's time per job (its p50) | round trip through the daemon | "
                  "transports and client |")
            print("|---|---|---|---|---|")
            for path in args.models:
                with Session(str(path), config=args.config) as local:
                    feeds = feeds_for(local.get_inputs())
                    remote = client.session(path)
                    here: list[float] = []
                    there: list[float] = []
                    for _ in range(50):
                        local.run(None, feeds)
                        remote.run(None, feeds)
                    block = 100
                    for _ in range(max(1, args.runs // block)):
                        for runner, out in ((local, here), (remote, there)):
                            for _ in range(block):
                                t0 = time.perf_counter()
                                runner.run(None, feeds)
                                out.append(time.perf_counter() - t0)
                    daemon_p50 = client.status()["latency_ms"]["p50"] * 1e3
                    remote.close()
                h, t = statistics.median(here) * 1e6, statistics.median(there) * 1e6
                print(f"| {path.stem} | {h:.1f} | {daemon_p50:.1f} | {t:.1f} | {t - daemon_p50:.1f} |", flush=True)
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()

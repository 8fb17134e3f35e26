"""Where one client's round trip through the daemon goes, in µs at the median.

Usage: python -m bench.round_trip_split MODEL.onnx [MODEL.onnx ...] [--runs 3000] [--config FILE]
                                        [--transport lane zmq]

For each model and transport it alternates blocks of ``Session.run`` in this process with blocks
of the same infer through a daemon (``vkpool serve`` on a temporary socket), and times the
client's side of each infer from its own clock:

- before: from the call to the request handed over (the inputs written in the lane's ring, or
  the last frame given to ZeroMQ);
- waiting: from then to the reply seen (in the ring, or its frames taken from ZeroMQ);
- after: from the reply seen to the outputs returned;

and reads the daemon's own time per job (``status``: from the request taken off its transport to
its reply written, the run included; over the last 1000 jobs, so each transport's model is
loaded afresh). ``waiting`` minus the daemon's time is what the hand-over costs both ways: the
daemon noticing the request, and the client noticing the reply (for ZeroMQ, libzmq's threads too).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", type=Path)
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--config", default=None)
    ap.add_argument("--transport", nargs="+", choices=("lane", "zmq"), default=["lane", "zmq"])
    args = ap.parse_args()
    from vkpool.daemon import lane as lane_module
    from vkpool.daemon import protocol
    from vkpool.daemon.bench import BenchDaemon, feeds_for

    from vkpool.session import Session

    sent: list[float] = []
    seen: list[float] = []
    clock = time.perf_counter

    def after(record: list[float], fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            got = fn(*a, **kw)
            record.append(clock())
            return got
        return timed

    lane_module.ClientLane.send_bound = after(sent, lane_module.ClientLane.send_bound)
    lane_module.ClientLane._from_ring = after(seen, lane_module.ClientLane._from_ring)
    protocol.send_parts = after(sent, protocol.send_parts)
    protocol.recv_parts = after(seen, protocol.recv_parts)
    daemon = BenchDaemon(args.config)
    try:
        print("| model | transport | in-process run | client: before | waiting | after | daemon's time per job "
              "(its p50) | hand-over both ways (waiting - daemon) | round trip | added |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for transport in args.transport:
            with daemon.client(local_lane=transport == "lane") as client:
                for path in args.models:
                    with Session(str(path), config=args.config) as local:
                        feeds = feeds_for(local.get_inputs())
                        remote = client.session(path)
                        here: list[float] = []
                        parts: list[tuple[float, float, float, float]] = []
                        for _ in range(50):
                            local.run(None, feeds)
                            remote.run(None, feeds)
                        block = 100
                        for _ in range(max(1, args.runs // block)):
                            for _ in range(block):
                                t0 = clock()
                                local.run(None, feeds)
                                here.append(clock() - t0)
                            for _ in range(block):
                                sent.clear()
                                seen.clear()
                                t0 = clock()
                                remote.run(None, feeds)
                                t3 = clock()
                                if len(sent) == 1 and seen:  # one request, and its reply seen
                                    parts.append((sent[0] - t0, seen[-1] - sent[0], t3 - seen[-1], t3 - t0))
                        daemon_p50 = client.status()["latency_ms"]["p50"] * 1e3
                        remote.close()
                    if not parts:
                        print(f"| {path.stem} | {transport} | no infer was one request and its reply (a framed "
                              "lane, or outputs too large for the ring) |")
                        continue
                    run = statistics.median(here) * 1e6
                    med = [statistics.median(p[i] for p in parts) * 1e6 for i in range(4)]
                    print(f"| {path.stem} | {transport} | {run:.1f} | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} | "
                          f"{daemon_p50:.1f} | {med[1] - daemon_p50:.1f} | {med[3]:.1f} | {med[3] - run:.1f} |",
                          flush=True)
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()

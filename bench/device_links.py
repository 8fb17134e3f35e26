"""Chunks on one device handing tensors over on the device (timeline semaphores) or through the host.

Run on a machine with a GPU (vkpool installed from source)::

    python -m bench.device_links --out device_links.json

The first device is split into two members (``split: 2``). Each workload is cut in two at its
balanced point (:func:`vkpool.placement.balanced_cut`), one half per member, and run as a
given plan three ways, alternating, ``--rounds`` times:

- **on the device** (threads of this process): the second chunk reads the first one's outputs
  where they were written and is submitted right after it, waiting on the device for the first
  chunk's timeline value;
- **through the host** (threads, ``Session(link_on_device=False)``): the first chunk's
  outputs are read into host memory when it is seen done, then written into the second chunk's
  inputs, which is then submitted (as between two devices);
- **processes**: one worker process per chunk (``Session(processes=True)``), each with its own
  logical device, the tensors staged through shared host memory.

Per way, and for the whole model as one chunk on one member (alternating with them):
throughput with ``--in-flight`` requests outstanding (after a second of the same load), then
latency (median of ``--runs`` runs one at a time, while the clocks are still up), and whether
the outputs are identical to the one member's. Prints markdown; ``--out``
writes JSON. ``--smoke`` scales the large workloads down (lavapipe).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.multi_gpu import _graph, _label, _model, latency_ms, report, throughput

WAYS = ("one", "device", "host", "processes")
WORKLOADS = ("mnist12_like", "mlp", "conv_few_15MB", "conv_many_255MB", "matmul_1GB_16layers")
CONFIG = "devices:\n  - match: {index: 0}\n    split: 2\n"


def measure(pool: Any, name: str, smoke: bool, runs: int, requests: int, in_flight: int, rounds: int) -> dict:
    from vkpool.placement import balanced_cut
    from vkpool.session import Session

    model, feeds = _model(name, smoke)
    members = [m.id for m in pool.vulkan_members][:2]
    row: dict[str, Any] = {"workload": _label(name, smoke)}
    with Session(model, pool=pool, device=members[0]) as one:
        expected = one.run(None, feeds)
        halves = balanced_cut(_graph(one), 2)
    plan = {op: members[k] for k, ops in enumerate(halves) for op in ops}
    samples: dict[str, dict[str, list[Any]]] = {way: {"ms": [], "per_s": []} for way in WAYS}
    for _ in range(rounds):
        for way in WAYS:
            session = (Session(model, pool=pool, device=members[0]) if way == "one" else
                       Session(model, pool=pool, plan=plan, processes=way == "processes",
                               link_on_device=way == "device"))
            with session:
                out = session.run(None, feeds)
                row[f"{way}_identical"] = row.get(f"{way}_identical", True) and all(
                    np.array_equal(a, b) for a, b in zip(out, expected))
                # throughput first: its second of load brings the clocks up for the latency after it
                samples[way]["per_s"].append(throughput(session, feeds, requests, in_flight))
                samples[way]["ms"].append(latency_ms(session, feeds, runs))
                if way == "one":
                    continue
                stages = session.executor.copies[0].stages
                row.setdefault("boundary_bytes", sum(t.nbytes for t in session.plan.transfers))
                row[f"{way}_linked"] = sum(len(getattr(s, "linked_preds", [])) for s in stages)
                if way != "processes":
                    samples[way].setdefault("stages_us", []).append(_stage_times(session, runs))
    for way, s in samples.items():
        row[f"{way}_ms"] = statistics.median(s["ms"])
        row[f"{way}_per_s"] = statistics.median(s["per_s"])
        row[f"{way}_samples"] = s
    return row


def _stage_times(split: Any, runs: int) -> list[float]:
    """Medians over the last ``runs`` requests (the one-at-a-time runs just traced), µs: chunk 1
    from its submission to its outputs read, chunk 2's submission after chunk 1's, chunk 2 from
    its submission to its outputs read, the whole request (chunk 1's submission to chunk 2's
    outputs read)."""
    by_request: dict[int, dict[int, Any]] = {}
    for e in split.trace():
        by_request.setdefault(e.request, {})[e.chunk] = e
    by_request = {r: by_request[r] for r in sorted(by_request)[-runs:]}
    rows = [(r[0].end_ns - r[0].start_ns, r[1].start_ns - r[0].start_ns, r[1].end_ns - r[1].start_ns,
             r[1].end_ns - r[0].start_ns) for r in by_request.values() if set(r) == {0, 1}]
    return [round(statistics.median(col) / 1e3, 1) for col in zip(*rows)] if rows else []


def markdown(result: dict) -> str:
    lines = [f"Device: {result['device']}; {result['runs']} runs per latency, {result['requests']} requests per "
             f"throughput with {result['in_flight']} in flight, medians of {result['rounds']} alternating rounds",
             "", "| workload | boundary | one member ms | on the device ms | through the host ms | processes ms | "
             "one member req/s | on the device req/s | through the host req/s | processes req/s | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        same = "yes" if all(r[f"{way}_identical"] for way in WAYS) else "NO"
        lines.append(f"| {r['workload']} | {r['boundary_bytes'] / 1024:.0f} KiB | "
                     + " | ".join(f"{r[f'{way}_ms']:.3f}" for way in WAYS) + " | "
                     + " | ".join(f"{r[f'{way}_per_s']:.0f}" for way in WAYS) + f" | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.device_links", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="large workloads scaled down (lavapipe)")
    parser.add_argument("--workloads", nargs="+", default=None, choices=WORKLOADS,
                        help="which workloads (default: all)")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per latency (default 200; smoke 5)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per throughput figure (default 2000; smoke 16)")
    parser.add_argument("--in-flight", type=int, default=8, help="requests kept outstanding (default 8)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds of both ways (default 3; smoke 1)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from vkpool.config.loader import parse_config
    from vkpool.pool import DevicePool

    runs = args.runs or (5 if args.smoke else 200)
    requests = args.requests or (16 if args.smoke else 2000)
    rounds = args.rounds or (1 if args.smoke else 3)
    pool = DevicePool.from_config(parse_config(CONFIG))
    try:
        result: dict[str, Any] = {"device": pool.vulkan_members[0].info.name, "runs": runs, "requests": requests,
                                  "in_flight": args.in_flight, "rounds": rounds, "rows": []}
        for name in args.workloads or WORKLOADS:
            result["rows"].append(measure(pool, name, args.smoke, runs, requests, args.in_flight, rounds))
            sys.stderr.write(f"{name} done\n")
    finally:
        pool.close()
    return report(result, markdown(result), args.out)


if __name__ == "__main__":
    sys.exit(main())

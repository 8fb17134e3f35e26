"""Dynamic batching in-process: jobs/s and latency of client threads sending back to back to one
Session, with batching off (``max_batch=1``: one request per run, through the same queue) and on.

    python -m bench.batching [WORKLOAD ...] [--clients 1 4 8 16] [--seconds 3] [--max-batch 16]
                             [--max-delay-us 0] [--device vk0] [--out FILE.json]

WORKLOAD is a name of ``bench/workloads.py`` (default ``mnist12_like``), exported with a symbolic
batch dimension (``bench.workloads.symbolic_batch``). Each client thread sends one row per request
and waits for its answer before sending the next. The table goes to stdout; ``--out`` also writes
the figures as JSON.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from typing import Any

import numpy as np

from bench import workloads as wl


def _measure(session: Any, feed: dict[str, np.ndarray], clients: int, seconds: float) -> dict[str, Any]:
    latencies: list[list[float]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients + 1)
    stop_at = [0.0]

    def client(i: int) -> None:
        start.wait()
        own = latencies[i]
        while True:
            t0 = time.perf_counter()
            if t0 >= stop_at[0]:
                return
            session.submit(feed).result()
            own.append(time.perf_counter() - t0)

    before = session.batching
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    stop_at[0] = time.perf_counter() + seconds
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    after = session.batching
    lat = np.concatenate([np.asarray(x) for x in latencies]) * 1e3
    batches = after["batches"] - before["batches"]
    return {"clients": clients, "jobs": int(lat.size), "jobs_per_s": lat.size / elapsed,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "batches": batches, "mean_batch": (after["requests"] - before["requests"]) / max(batches, 1)}


def _variant_runs(model: bytes, feed: dict[str, np.ndarray], pool: Any, device: str,
                  max_batch: int) -> list[dict[str, Any]]:
    """Median run time of each compiled batch size, one caller, no queue: the ceiling of batching."""
    import vkpool
    from vkpool.batching import variant_sizes

    out = []
    print("| batch size | run median ms | rows/s |")
    print("|---|---|---|")
    for size in variant_sizes(max_batch):
        x = {"x": np.repeat(feed["x"], size, axis=0)}
        with vkpool.Session(model, pool=pool, device=device, batch=size) as s:
            for _ in range(20):
                s.run(None, x)
            times = []
            for _ in range(100):
                t0 = time.perf_counter()
                s.run(None, x)
                times.append(time.perf_counter() - t0)
        ms = float(np.median(times)) * 1e3
        out.append({"batch_size": size, "run_ms": ms, "rows_per_s": size / ms * 1e3})
        print(f"| {size} | {ms:.3f} | {size / ms * 1e3:,.0f} |", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.batching", description=__doc__.split("\n")[0])
    parser.add_argument("workloads", nargs="*", default=["mnist12_like"])
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4, 8, 16])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-delay-us", type=float, default=0.0)
    parser.add_argument("--device", default=None, help="pool member (default: the first Vulkan member)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if min(args.clients) < 1 or args.seconds <= 0 or args.max_batch < 1 or args.max_delay_us < 0:
        parser.error("--clients, --seconds and --max-batch must be positive, --max-delay-us >= 0")

    import vkpool
    from vkpool.pool import DevicePool

    pool = DevicePool.from_config(None)
    device = args.device or pool.vulkan_members[0].id
    rows: list[dict[str, Any]] = []
    for name in args.workloads:
        model = wl.symbolic_batch(wl.build(name)).SerializeToString()
        feed = wl.input_for(name)
        runs = _variant_runs(model, feed, pool, device, args.max_batch)
        rows.extend(dict(workload=name, device=device, **r) for r in runs)
        print("| workload | batching | clients | jobs/s | p50 ms | p99 ms | mean batch |")
        print("|---|---|---|---|---|---|---|")
        for max_batch in (1, args.max_batch):
            label = "off" if max_batch == 1 else f"max {max_batch}, delay {args.max_delay_us:g} us"
            with vkpool.Session(model, pool=pool, device=device, max_batch=max_batch,
                                max_queue_delay=args.max_delay_us * 1e-6) as session:
                for size in (1, max_batch):  # compile the variants before timing
                    session.submit({"x": np.repeat(feed["x"], size, axis=0)}).result()
                for clients in args.clients:
                    r = _measure(session, feed, clients, args.seconds)
                    r.update(workload=name, max_batch=max_batch, max_delay_us=args.max_delay_us, device=device)
                    rows.append(r)
                    print(f"| {name} | {label} | {clients} | {r['jobs_per_s']:,.0f} | {r['p50_ms']:.3f} | "
                          f"{r['p99_ms']:.3f} | {r['mean_batch']:.2f} |", flush=True)
    pool.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

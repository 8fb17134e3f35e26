"""Would several daemon processes serve more than one? The clients of ``vkpool.daemon.bench`` are
dealt to K independent daemons (each a ``vkpool serve`` of its own, with its own copy of the model,
on the same devices), started together, and the jobs/s they complete together are counted: the
ceiling a daemon that shards its clients over K serving processes could reach, against K = 1
(today's daemon), in the same run.

    python -m bench.daemon_shards [MODEL] [--shards 1 2 4 8] [--clients 16 64] [--seconds 3]
                                  [--max-batch N] [--transport lane|zmq] [--per-device N]

Each cell gives jobs/s, p50 / p99 latency (µs) and the CPU cores busy in the daemons together.
``--per-device N`` (a machine with N Vulkan devices): daemon k sees device k mod N alone (a config
excluding the others, the host member off), so K daemons on K devices are the ceiling of a daemon
that serves each device from a process of its own, against one daemon on one device.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from vkpool.daemon import bench as B

    parser = argparse.ArgumentParser(prog="python -m bench.daemon_shards", description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="mnist12_like")
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--transport", choices=["lane", "zmq"], default="lane")
    parser.add_argument("--per-device", type=int, metavar="N",
                        help="N Vulkan devices: daemon k sees device k mod N alone")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="vkpool-shards-"))
    batching = None if args.max_batch is None else {"max_batch": args.max_batch, "max_queue_delay": 0.0}
    rows = []
    try:
        model = B.resolve_model(args.model, work, symbolic_batch=batching is not None)
        for k in args.shards:
            daemons = [B.BenchDaemon(_device_config(work, i % args.per_device, args.per_device)
                                     if args.per_device else None) for i in range(k)]
            try:
                for d in daemons:  # each loads (and compiles) the model before the clients start
                    with d.client(local_lane=args.transport == "lane") as c:
                        c.session(model, **(batching or {}))
                cells = []
                for n in args.clients:
                    r = B.throughput([d.endpoint for d in daemons], model, n, args.seconds, args.transport,
                                     batching, [d.proc.pid for d in daemons])
                    cells.append(f"{r['jobs_per_s']:.0f} ({r['p50_us']:.0f} / {r['p99_us']:.0f}; "
                                 f"{r['daemon_cpu']:.2f})")
                rows.append(f"| {k} | " + " | ".join(cells) + " |")
                print(rows[-1], flush=True)
            finally:
                for d in daemons:
                    d.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mode = "fixed batch" if batching is None else f"dynamic batching, max_batch {args.max_batch}"
    where = f", daemon k on device k mod {args.per_device} alone" if args.per_device else ""
    print(f"\n{args.model}, {args.transport}, {mode}{where}, {args.seconds:g} s per figure\n")
    print("| daemons | " + " | ".join(f"{n} clients: jobs/s (p50 / p99 µs; daemon CPU)" for n in args.clients) + " |")
    print("|---|" + "---|" * len(args.clients))
    print("\n".join(rows))
    return 0


def _device_config(folder: Path, keep: int, devices: int) -> str:
    """A config file that leaves every Vulkan device but index ``keep`` (of ``devices``) out, and the host member."""
    path = folder / f"device-{keep}.yaml"
    rules = "".join(f"  - match: {{index: {i}}}\n    exclude: true\n" for i in range(devices) if i != keep)
    path.write_text(("devices:\n" + rules if rules else "") + "host:\n  enabled: false\n")
    return str(path)


if __name__ == "__main__":
    raise SystemExit(main())

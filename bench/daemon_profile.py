"""Where the daemon's time goes under load: py-spy samples the daemon while client processes send
jobs back to back (``vkpool.daemon.bench``'s clients), and the samples are summed per function.

    python -m bench.daemon_profile MODEL [--clients 16] [--seconds 5] [--max-batch N]
                                   [--transport lane|zmq] [--config FILE] [--out FOLDER]

Needs ``py-spy`` on the PATH (or beside the interpreter). Writes ``FOLDER/daemon-profile.txt`` (the
collapsed stacks py-spy recorded, one per line with its sample count) and prints the functions
holding the most samples, by their own time and by their time with what they call.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path


def summarize(collapsed: str, top: int = 25) -> str:
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        samples += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    lines = [f"{samples} samples", "", "own time:"]
    lines += [f"  {100 * n / samples:5.1f}%  {f}" for f, n in own.most_common(top)]
    lines += ["", "with callees:"]
    lines += [f"  {100 * n / samples:5.1f}%  {f}" for f, n in total.most_common(top)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vkpool.daemon import bench as B

    parser = argparse.ArgumentParser(prog="python -m bench.daemon_profile", description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--max-batch", type=int)
    parser.add_argument("--transport", choices=["lane", "zmq"], default="lane")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--gil", action="store_true", help="sample only the thread holding the GIL")
    parser.add_argument("--config", type=Path, help="the daemon's config file (default: vkpool's own)")
    parser.add_argument("--objective", choices=["latency", "throughput"],
                        help="load the model for this objective (throughput: a copy on every member)")
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    work = Path(tempfile.mkdtemp(prefix="vkpool-profile-"))
    batching = None if args.max_batch is None else {"max_batch": args.max_batch, "max_queue_delay": 0.0}
    load = {**(batching or {}), **({"objective": args.objective} if args.objective else {})}
    model = B.resolve_model(args.model, work, symbolic_batch=batching is not None)
    daemon = B.BenchDaemon(None if args.config is None else str(args.config))
    try:
        with daemon.client(local_lane=args.transport == "lane") as c:
            c.session(model, **load)  # loaded (and compiled) before the clients start
            raw = args.out / "daemon-profile.txt"
            args.out.mkdir(parents=True, exist_ok=True)
            spy_args = [spy, "record", "-p", str(daemon.proc.pid), "-d", str(max(1, int(args.seconds) - 1)),
                        "-r", "500", "-f", "raw", "-o", str(raw), "--threads", "--nonblocking",
                        *(["--gil"] if args.gil else [])]
            recording: list[subprocess.Popen] = []
            # sampled while the clients run, not while they start
            result = B.throughput(daemon.endpoint, model, args.clients, args.seconds, args.transport, load,
                                  daemon.proc.pid, lambda: recording.append(subprocess.Popen(
                                      spy_args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
            for proc in recording:
                proc.wait(60)
        print(f"{args.clients} clients over {args.transport}: {result}")
        if raw.exists():
            print(summarize(raw.read_text()))
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

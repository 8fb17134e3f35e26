"""Latency through the daemon against in-process, and jobs/s with several client processes.

    python -m vkpool.daemon.bench model.onnx [--runs 300] [--seconds 3] [--clients 1 4 16]

Starts its own daemon on a temporary ipc socket (with the default config, or --config), feeds
random inputs, and prints a markdown table.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

_CLIENT = """
import sys, time, numpy as np
from vkpool.daemon.client import Client
endpoint, model, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
with Client(endpoint) as client:
    session = client.session(model)
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(i.dtype)
             for i in session.get_inputs()}
    session.run(None, feeds)
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    sys.stdin.readline()
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        session.run(None, feeds); n += 1
    print(n)
"""


def _feeds(inputs: list) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(i.dtype)
            for i in inputs}


def _latency(run, feeds: dict[str, np.ndarray], runs: int) -> tuple[float, float]:
    for _ in range(10):
        run(None, feeds)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        run(None, feeds)
        times.append(time.perf_counter() - t)
    p50, p99 = np.percentile(np.array(times) * 1e3, [50, 99])
    return float(p50), float(p99)


def _throughput(endpoint: str, model: str, clients: int, seconds: float) -> float:
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, endpoint, model, str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(clients)]
    for p in procs:
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("a bench client failed to start")
    for p in procs:  # start together
        p.stdin.write("go\n")
        p.stdin.flush()
    total = sum(int(p.communicate(timeout=seconds + 120)[0].strip()) for p in procs)
    return total / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vkpool.daemon.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="ONNX model file")
    parser.add_argument("--config", help="config file for the pool (both in-process and daemon)")
    parser.add_argument("--runs", type=int, default=300, help="runs per latency measurement")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each throughput measurement")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args(argv)
    model = str(Path(args.model).resolve())

    from vkpool.session import Session

    with Session(model, config=args.config) as session:
        feeds = _feeds(session.get_inputs())
        local = _latency(session.run, feeds, args.runs)
        where = session.member.id

    folder = tempfile.mkdtemp(prefix="vkb", dir="/tmp")
    endpoint = f"ipc://{folder}/bench.sock"
    cmd = [sys.executable, "-m", "vkpool", *(["--config", args.config] if args.config else []),
           "serve", "--endpoint", endpoint]
    daemon = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        from vkpool.daemon.client import Client
        from vkpool.daemon.errors import DaemonUnavailable

        deadline = time.monotonic() + 60
        while True:
            try:
                client = Client(endpoint, hello_timeout=2)
                break
            except DaemonUnavailable:
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with client:
            remote_session = client.session(model)
            remote = _latency(remote_session.run, feeds, args.runs)
            rates = {n: _throughput(endpoint, model, n, args.seconds) for n in args.clients}
    finally:
        daemon.terminate()
        daemon.wait(60)
        os.rmdir(folder) if os.path.isdir(folder) and not os.listdir(folder) else None

    print(f"model `{Path(model).name}` on {where}, {os.cpu_count()} CPU cores\n")
    print("| path | p50 latency (ms) | p99 latency (ms) |")
    print("|---|---|---|")
    print(f"| in-process Session | {local[0]:.3f} | {local[1]:.3f} |")
    print(f"| through the daemon (1 client) | {remote[0]:.3f} | {remote[1]:.3f} |")
    print(f"| daemon overhead | {remote[0] - local[0]:.3f} | |\n")
    print("| client processes | jobs/s (total) |")
    print("|---|---|")
    for n, rate in rates.items():
        print(f"| {n} | {rate:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

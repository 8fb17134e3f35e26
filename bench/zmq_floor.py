"""What a ZeroMQ round trip costs on this machine, with nothing of vkpool on it.

Usage: python -m bench.zmq_floor [--runs 5000] [--bytes 3136] [--poll-us 400]

A DEALER in this process and a ROUTER in a child process, over ipc, bounce an infer-shaped message
(a short header frame and one tensor frame of ``--bytes``). Each side either sleeps in
``zmq_poll`` until the message comes, or polls (``zmq_poll`` without waiting) for up to
``--poll-us`` first. Prints the median and p90 round trip, in µs, for the four combinations: the
floor under the daemon's "added, ZeroMQ" figure (``python -m vkpool.daemon.bench``).
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import zmq


def _wait(poller: zmq.Poller, poll_s: float) -> None:
    if poll_s > 0:
        until = time.perf_counter() + poll_s
        while not poller.poll(0):
            if time.perf_counter() > until:
                break
        else:
            return
    poller.poll()


def _echo(endpoint: str, poll_s: float) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while True:
        _wait(poller, poll_s)
        message = router.recv_multipart(copy=False)
        router.send_multipart(message, copy=False)
        if message[-1].bytes == b"stop":
            break
    router.close(linger=1000)
    ctx.term()


def round_trips(runs: int, size: int, client_poll_s: float, server_poll_s: float) -> list[float]:
    folder = tempfile.mkdtemp(prefix="zf", dir="/tmp")
    endpoint = f"ipc://{Path(folder) / 'floor.sock'}"
    child = multiprocessing.get_context("spawn").Process(target=_echo, args=(endpoint, server_poll_s))
    child.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    message = [b"\x82\xa4type\xadinfer_request\xa2id\xa5a-123", b"\0" * size]
    times: list[float] = []
    for k in range(runs + 200):  # the first 200: warm-up
        t0 = time.perf_counter()
        dealer.send_multipart(message)
        _wait(poller, client_poll_s)
        dealer.recv_multipart()
        if k >= 200:
            times.append(time.perf_counter() - t0)
    dealer.send_multipart([b"stop"])
    dealer.recv_multipart()
    child.join(10)
    dealer.close(linger=0)
    ctx.term()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5000)
    ap.add_argument("--bytes", type=int, default=3136, help="the tensor frame (mnist12_like's input: 3136)")
    ap.add_argument("--poll-us", type=float, default=400.0)
    args = ap.parse_args()
    poll_s = args.poll_us * 1e-6
    print(f"ZeroMQ {zmq.zmq_version()}, pyzmq {zmq.__version__}; {args.runs} round trips of a "
          f"{args.bytes}-byte tensor over ipc; µs")
    print("| client | server | median | p90 |")
    print("|---|---|---|---|")
    for client in (0.0, poll_s):
        for server in (0.0, poll_s):
            times = sorted(round_trips(args.runs, args.bytes, client, server))
            label = {0.0: "sleeps"}.get
            print(f"| {label(client, 'polls')} | {label(server, 'polls')} | {statistics.median(times) * 1e6:.1f} | "
                  f"{times[int(len(times) * 0.9)] * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()

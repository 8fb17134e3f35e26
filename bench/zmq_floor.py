"""What a ZeroMQ round trip costs on this machine, with nothing of vkpool on it.

Usage: python -m bench.zmq_floor [--runs 5000] [--bytes 3136] [--poll-us 400] [--work-us 0 50]
                                [--pin none same apart]

A DEALER in this process and a ROUTER in a child process, over ipc, bounce an infer-shaped message
(a short header frame and one tensor frame of ``--bytes``). Each side either sleeps in
``zmq_poll`` until the message comes, or polls (``zmq_poll`` without waiting) for up to
``--poll-us`` first. Prints the median and p90 round trip, in µs, for the four combinations: the
floor under the daemon's "added, ZeroMQ" figure (``python -m vkpool.daemon.bench``).

Then, both sides polling, the server busy for each ``--work-us`` before it answers (a model's
run), with each ``--pin``: ``none`` (the scheduler places every thread), ``same`` (each side's
thread and its context's I/O thread held on one CPU of their own, ``ZMQ_THREAD_AFFINITY_CPU_ADD``)
or ``apart`` (each on a CPU of its own). Round trip minus the work is printed beside each.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from pathlib import Path

import zmq

from bench.stats import spin


def _wait(poller: zmq.Poller, poll_s: float) -> None:
    if poll_s > 0:
        until = time.perf_counter() + poll_s
        while not poller.poll(0):
            if time.perf_counter() > until:
                break
        else:
            return
    poller.poll()


def _context(cpus: tuple[int, int] | None) -> zmq.Context:
    """A context whose I/O thread is held on ``cpus[1]``, this thread on ``cpus[0]``; or as is."""
    ctx = zmq.Context()
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[0]})
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, cpus[1])
    return ctx


def _echo(endpoint: str, poll_s: float, work_s: float = 0.0, cpus: tuple[int, int] | None = None) -> None:
    ctx = _context(cpus)
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    while True:
        _wait(poller, poll_s)
        message = router.recv_multipart(copy=False)
        if work_s:
            spin(work_s)
        router.send_multipart(message, copy=False)
        if message[-1].bytes == b"stop":
            break
    router.close(linger=1000)
    ctx.term()


def round_trips(runs: int, size: int, client_poll_s: float, server_poll_s: float, work_s: float = 0.0,
                pin: str = "none") -> list[float]:
    folder = tempfile.mkdtemp(prefix="zf", dir="/tmp")
    endpoint = f"ipc://{Path(folder) / 'floor.sock'}"
    cpus = sorted(os.sched_getaffinity(0))
    client_cpus = server_cpus = None
    if pin == "same":
        client_cpus, server_cpus = (cpus[-1], cpus[-1]), (cpus[-2], cpus[-2])
    elif pin == "apart":
        client_cpus, server_cpus = (cpus[-1], cpus[-2]), (cpus[-3], cpus[-4])
    child = multiprocessing.get_context("spawn").Process(
        target=_echo, args=(endpoint, server_poll_s, work_s, server_cpus))
    child.start()
    mask = os.sched_getaffinity(0)
    ctx = _context(client_cpus)
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
    os.sched_setaffinity(0, mask)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5000)
    ap.add_argument("--bytes", type=int, default=3136, help="the tensor frame (mnist12_like's input: 3136)")
    ap.add_argument("--poll-us", type=float, default=400.0)
    ap.add_argument("--work-us", type=float, nargs="+", default=[0.0, 50.0],
                    help="the server's busy time before each answer, both sides polling")
    ap.add_argument("--pin", nargs="+", choices=("none", "same", "apart"), default=None,
                    help="default: all three (apart only with 4 CPUs or more)")
    args = ap.parse_args()
    poll_s = args.poll_us * 1e-6
    cpus = len(os.sched_getaffinity(0))
    if args.pin is None:
        args.pin = ["none", "same", "apart"] if cpus >= 4 else ["none", "same"]
    elif cpus < max({"none": 1, "same": 2, "apart": 4}[pin] for pin in args.pin):
        raise SystemExit(f"--pin {' '.join(args.pin)} needs more CPUs than the {cpus} this process may use")
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
    print("\nboth polling, the server busy before each answer; µs")
    print("| server's work | threads | median | p90 | median minus the work |")
    print("|---|---|---|---|---|")
    for work_us in args.work_us:
        for pin in args.pin:
            times = sorted(round_trips(args.runs, args.bytes, poll_s, poll_s, work_us * 1e-6, pin))
            median = statistics.median(times) * 1e6
            print(f"| {work_us:g} | {pin} | {median:.1f} | {times[int(len(times) * 0.9)] * 1e6:.1f} | "
                  f"{median - work_us:.1f} |", flush=True)


if __name__ == "__main__":
    main()

"""Where one ZeroMQ client's round trip through the daemon goes, step by step, in µs at the median.

Usage: python -m bench.zmq_timeline MODEL.onnx [--runs 3000] [--config FILE]

Runs the daemon's server in a thread of this process and one client in a child process that
sends ``--runs`` infers back to back over ZeroMQ (no local lane). Both sides note
``time.perf_counter()`` (``CLOCK_MONOTONIC``, one clock for every process of the machine) at each
step of every infer, so the legs between the processes are measured, not inferred:

- client, before: from ``run()`` called to the request's first frame given to ZeroMQ;
- client, send: the request's frames given to ZeroMQ;
- to the daemon: from the client's last frame given to the daemon's I/O thread seeing the request;
- daemon, read: the frames taken off the router;
- daemon, handling: from the request read to its reply's first frame given to ZeroMQ (the run);
- daemon, send: the reply's frames given to ZeroMQ;
- to the client: from the daemon's last frame given to the client seeing the reply;
- client, after: from the reply seen to ``run()`` returning;
- and inside "daemon, handling", the daemon's ``Session.run``.

``--stub-run``: every ``Session.run`` after a session's first gives that first run's outputs
again, so that "daemon, handling" is the daemon's own Python. ``--profile``: the daemon's I/O
thread runs under ``cProfile`` (slower; for where, not how long), its top functions printed.

Beside them the in-process ``Session.run`` and ``python -m bench.zmq_floor``'s legs would show
what is the transport's and what is vkpool's.
"""
from __future__ import annotations

import bisect
import cProfile
import json
import pstats
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

CLIENT = """
import json, sys, time
from vkpool.daemon import protocol as P
from vkpool.daemon.bench import feeds_for
from vkpool.daemon.client import Client
endpoint, model, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
clock = time.perf_counter
marks = []
send, recv = P.send_parts, P.recv_parts

def timed_send(sock, parts, **kw):
    t0 = clock()
    send(sock, parts, **kw)
    marks.append(("send", t0, clock()))

def timed_recv(sock, copied):
    t0 = clock()
    got = recv(sock, copied)
    marks.append(("recv", t0, clock()))
    return got

P.send_parts, P.recv_parts = timed_send, timed_recv
with Client(endpoint, local_lane=False) as client:
    remote = client.session(model)
    feeds = feeds_for(remote.get_inputs())
    runs_at = []
    for _ in range(runs):
        del marks[:]
        t0 = clock()
        remote.run(None, feeds)
        t5 = clock()
        sends = [m for m in marks if m[0] == "send"]
        recvs = [m for m in marks if m[0] == "recv"]
        if len(sends) == 1 and len(recvs) == 1:
            runs_at.append((t0, sends[0][1], sends[0][2], recvs[0][1], recvs[0][2], t5))
        else:
            runs_at.append(None)
    print(json.dumps(runs_at), flush=True)
"""

LEGS = ("client, before", "client, send", "to the daemon", "daemon, read", "daemon, handling",
        "daemon, send", "to the client", "client, after")


def main() -> None:
    from bench.daemon_own_time import one_client_parser

    ap = one_client_parser(__doc__)
    ap.add_argument("--profile", action="store_true", help="profile the daemon's I/O thread (see above)")
    args = ap.parse_args()
    import zmq
    from vkpool.daemon import lane as lane_module
    from vkpool.daemon import protocol as P
    from vkpool.daemon import server as server_module

    from bench.daemon_own_time import (
        busy_threads,
        in_process_us,
        serve_in_thread,
        stub_session_runs,
        thread_cpu,
        timed,
    )
    from vkpool.session import Session

    clock = time.perf_counter
    in_process, _, _ = in_process_us(args.model, args.config, args.runs)
    if args.stub_run:
        stub_session_runs()
    runs_inside: list[float] = []  # on whichever thread runs it: the I/O thread, or a model's worker
    Session.run = timed(Session.run, runs_inside)  # type: ignore[method-assign]

    seen: list[float] = []  # the I/O thread's poll returned with something
    reads: list[tuple[float, float]] = []
    sends: list[tuple[float, float]] = []
    io: list[int] = []
    spin = lane_module.Poller.spin

    def timed_spin(self: Any, ready: Any, usual_s: float, since: float) -> Any:
        got = spin(self, ready, usual_s, since)
        if got and threading.get_ident() in io:
            seen.append(clock())
        return got

    Server = server_module.Server
    recv_request = Server._recv_request

    def timed_recv(self: Any) -> Any:
        if not io:
            io.append(threading.get_ident())
        t0 = clock()
        got = recv_request(self)
        reads.append((t0, clock()))
        return got

    send_parts = P.send_parts

    def timed_send(sock: Any, parts: Any, **kw: Any) -> None:
        t0 = clock()
        send_parts(sock, parts, **kw)
        if sock.type == zmq.ROUTER:
            sends.append((t0, clock()))

    lane_module.Poller.spin = timed_spin
    Server._recv_request = timed_recv
    P.send_parts = timed_send
    profile = cProfile.Profile() if args.profile else None
    wrap = None if profile is None else (lambda serve: lambda: profile.runcall(serve))
    server, thread, endpoint = serve_in_thread(args.config, wrap)
    try:
        cpu_before, wall_before = thread_cpu(), clock()
        command = [sys.executable, "-c", CLIENT, endpoint, str(args.model.resolve()), str(args.runs)]
        child = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if child.returncode != 0 or not child.stdout.strip():
            raise SystemExit(f"the client failed:\n{child.stderr[-3000:]}")
        client_runs = json.loads(child.stdout.strip().splitlines()[-1])
        busy = busy_threads(cpu_before, thread_cpu(), clock() - wall_before)
    finally:
        server.request_stop()
        thread.join(30)
    legs: dict[str, list[float]] = {leg: [] for leg in LEGS}
    rounds = []
    skip = min(200, args.runs // 10)
    for marks in client_runs[skip:]:
        if marks is None:
            continue
        t0, c1, c2, c3, c4, t5 = marks
        # the daemon's read after this request went, and its reply's send before the reply was seen
        k = bisect.bisect_left(reads, (c2,))
        r = reads[k] if k < len(reads) else None
        k = bisect.bisect_left(sends, (r[1],)) if r is not None else len(sends)
        s = sends[k] if k < len(sends) else None
        if r is None or s is None or s[1] > c3:
            continue
        k = bisect.bisect_right(seen, r[0])
        w = seen[k - 1] if k and seen[k - 1] >= c2 else r[0]  # the poll that saw it, or the read itself
        values = (c1 - t0, c2 - c1, w - c2, r[1] - r[0], s[0] - r[1], s[1] - s[0], c3 - s[1], t5 - c3)
        for leg, value in zip(LEGS, values):
            legs[leg].append(value)
        rounds.append(t5 - t0)
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    print("threads of the daemon's process busy while the client ran (share of a core): "
          + ", ".join(f"{name} {share:.2f}" for name, share in busy))
    med = {leg: statistics.median(v) * 1e6 for leg, v in legs.items() if v}
    rt = statistics.median(rounds) * 1e6
    print(f"{args.model.stem}: {len(rounds)} infers matched of {len(client_runs) - skip}; µs, medians")
    inside = statistics.median(runs_inside[skip:]) * 1e6
    print("| in-process run | round trip | added | " + " | ".join(LEGS) + " | Session.run in the daemon |")
    print("|---" * (len(LEGS) + 4) + "|")
    values = (in_process, rt, rt - in_process, *(med.get(leg, 0.0) for leg in LEGS), inside)
    cells = [f"{v:.1f}" for v in values]
    if args.stub_run:
        cells[2] = "-"  # the round trip holds no run: nothing to set the in-process run against
    print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

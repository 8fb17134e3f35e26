"""What the daemon does with one client's bound infer besides running it, in µs at the median.

Usage: python -m bench.daemon_own_time MODEL.onnx [--runs 3000] [--config FILE] [--stub-run]

Runs the daemon's server in a thread of this process (the model's session is the daemon's own)
and a client in a child process that sends ``--runs`` bound infers back to back over the local
lane. Each step of the lanes' thread on the way of a request is timed from this process's clock
(a wrapper around it, so each adds a few tenths of a microsecond):

- pass: the lanes' pass over what it read (``Server._lanes_passed``), the request's whole stay in
  the daemon after it was taken off its ring;
- run_bound: the service running the model's bound infers (claim, run, answers);
- Session.run: the run itself, timed inside the daemon; beside it the same model's ``Session.run``
  in this process before the daemon starts ("in-process run"), and the daemon's own session run
  from this process's main thread once the client is done (the model still loaded);
- answer: the outputs written in the client's ring (``Server._answer_bound``);
- the daemon's own p50 (``status``: from the request taken off the lane to its reply written);
- the client's round trip (its median, from its own clock);
- how often the lanes' thread stopped polling and slept until a client woke it, the garbage
  collections of the daemon's process and the threads that kept a core busy meanwhile.

``--keep-local``: the in-process session stays open (idle) while the daemon serves, as it does in
benches that alternate in-process runs with runs through the daemon.

``--pin``: the in-process runs and then the lanes' thread run on one CPU, the client on another,
and the daemon's other threads and this process's main thread (the direct runs) on the rest: a
probe of whether moving between CPUs, or sharing one, is what slows a run inside the daemon.

``--stub-run``: every ``Session.run`` after a session's first gives that first run's outputs again,
so that what is left is the daemon's and the client's own work: the daemon's Python per request.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

CLIENT = """
import os, sys, time
from vkpool.daemon.bench import feeds_for
from vkpool.daemon.client import Client
endpoint, model, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Client(endpoint, local_lane=True) as client:
    remote = client.session(model)
    feeds = feeds_for(remote.get_inputs())
    if len(sys.argv) > 4:  # --pin: this thread only, once the client polls (it does on 4 CPUs or more)
        os.sched_setaffinity(0, {int(sys.argv[4])})
    took = []
    for _ in range(runs):
        t0 = time.perf_counter()
        remote.run(None, feeds)
        took.append(time.perf_counter() - t0)
    took = sorted(took[min(200, runs // 10):])
    print(took[len(took) // 2] * 1e6, client.status()["latency_ms"]["p50"] * 1e3, flush=True)
    sys.stdin.readline()  # the model stays loaded while the daemon's session is timed directly
"""


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each thread of this process so far, by name (Linux: /proc/self/task)."""
    tick = os.sysconf("SC_CLK_TCK")
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = names.get(int(task.name)) or (task / "comm").read_text().strip() + " (not Python's)"
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        key = f"{name}/{task.name}"
        out[key] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def busy_threads(before: dict[str, float], after: dict[str, float], wall: float) -> list[tuple[str, float]]:
    shares = [(name.split("/")[0], (cpu - before.get(name, 0.0)) / wall) for name, cpu in after.items()]
    return sorted(((n, s) for n, s in shares if s >= 0.02), key=lambda ns: -ns[1])


def timed(fn: Any, into: list[float], threads: list[int] | None = None) -> Any:
    """``fn`` wrapped so that each call's duration (s) is appended to ``into``; with ``threads``,
    only calls made on a thread of that list (filled once the thread is known)."""
    clock = time.perf_counter

    def wrapper(*a: Any, **kw: Any) -> Any:
        t0 = clock()
        try:
            return fn(*a, **kw)
        finally:
            if threads is None or threading.get_ident() in threads:
                into.append(clock() - t0)
    return wrapper


def in_process_us(model: Path, config: str | None, runs: int, keep: bool = False) -> tuple[float, Any, Any]:
    """The median ``Session.run`` of ``model`` in this process (µs, after a warm-up of up to 200
    runs), the feeds it ran on, and the session, closed unless ``keep``."""
    from vkpool.daemon.bench import feeds_for

    from vkpool.session import Session

    clock = time.perf_counter
    local = Session(str(model), config=config)
    feeds = feeds_for(local.get_inputs())
    alone = []
    for _ in range(runs):
        t0 = clock()
        local.run(None, feeds)
        alone.append(clock() - t0)
    if not keep:
        local.close()
    return statistics.median(alone[min(200, runs // 10):]) * 1e6, feeds, local


def stub_session_runs() -> None:
    """Every ``Session.run`` after a session's first gives that first run's outputs again (see
    ``--stub-run``)."""
    from vkpool.session import Session

    first: dict[int, Any] = {}
    real_run = Session.run

    def stub(self: Any, *a: Any, **kw: Any) -> Any:
        if id(self) not in first:
            first[id(self)] = real_run(self, *a, **kw)
        return first[id(self)]
    Session.run = stub  # type: ignore[method-assign]


def serve_in_thread(config: str | None, wrap: Any = None) -> tuple[Any, threading.Thread, str]:
    """The daemon's server on an ipc endpoint of its own, serving in a thread of this process
    (``wrap(serve_forever)``: what the thread runs instead, when given): the server, the thread
    and the endpoint. Stop it with ``server.request_stop()`` and join the thread."""
    from vkpool.daemon.main import load_settings
    from vkpool.daemon.runtime import Runtime
    from vkpool.daemon.server import Server

    cfg, settings = load_settings(config)
    folder = Path(tempfile.mkdtemp(prefix="vko", dir="/tmp"))
    server = Server(Runtime.from_config(cfg), settings, endpoint := f"ipc://{folder}/own.sock")
    thread = threading.Thread(target=server.serve_forever if wrap is None else wrap(server.serve_forever),
                              daemon=True)
    thread.start()
    return server, thread, endpoint


def one_client_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments of the benches that time one client against a daemon served in a thread of
    their own process: the model, ``--runs``, ``--config`` and ``--stub-run``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--runs", type=int, default=3000)
    ap.add_argument("--config", default=None)
    ap.add_argument("--stub-run", action="store_true", help="leave the model's run out (see above)")
    return ap


def main() -> None:
    ap = one_client_parser(__doc__)
    ap.add_argument("--pin", action="store_true", help="hold the threads on CPUs of their own (see above)")
    ap.add_argument("--keep-local", action="store_true",
                    help="keep the in-process session (its device) open, idle, while the daemon serves")
    args = ap.parse_args()
    from vkpool.daemon import server as server_module
    from vkpool.daemon import service as service_module

    from vkpool.session import Session

    times: dict[str, list[float]] = defaultdict(list)
    clock = time.perf_counter
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) < 3:
        raise SystemExit(f"--pin needs 3 CPUs, this process may use {len(cpus)}")
    lane_cpu, client_cpu = (cpus[1], cpus[len(cpus) // 2]) if args.pin else (None, None)
    if lane_cpu is not None:
        os.sched_setaffinity(0, {lane_cpu})  # Linux: 0 is the calling thread
    in_process, feeds, local = in_process_us(args.model, args.config, args.runs, keep=args.keep_local)
    if args.stub_run:
        stub_session_runs()
    lanes: list[int] = []

    Server = server_module.Server
    passed = Server._lanes_passed

    def lanes_passed(self: Any) -> None:
        if not lanes:
            lanes.append(threading.get_ident())
            if lane_cpu is not None:
                os.sched_setaffinity(0, {lane_cpu})
        t0 = clock()
        had = bool(self._bound)
        passed(self)
        if had:
            times["pass"].append(clock() - t0)

    Server._lanes_passed = lanes_passed
    from vkpool.daemon import lane as lane_module
    mark_rings = lane_module.LaneReactor._mark_rings
    sleeps = [0]

    def marked(self: Any, asleep: bool) -> bool:
        sleeps[0] += bool(asleep)
        return mark_rings(self, asleep)

    lane_module.LaneReactor._mark_rings = marked
    Server._answer_bound = timed(Server._answer_bound, times["answer"])
    service_module.Service.run_bound = timed(service_module.Service.run_bound, times["run_bound"])
    Session.run = timed(Session.run, times["Session.run"], lanes)

    if lane_cpu is not None:  # the server's threads start on the others; the lanes' thread moves at its first pass
        os.sched_setaffinity(0, set(cpus) - {lane_cpu, client_cpu})
    server, thread, endpoint = serve_in_thread(args.config)
    try:
        gc_spent: dict[int, list[float]] = defaultdict(list)
        gc_started = [0.0]

        def gc_timed(phase: str, info: dict[str, Any]) -> None:
            if phase == "start":
                gc_started[0] = clock()
            else:
                gc_spent[info["generation"]].append(clock() - gc_started[0])

        gc.callbacks.append(gc_timed)
        cpu_before, wall_before = thread_cpu(), clock()
        pin = [] if client_cpu is None else [str(client_cpu)]
        child = subprocess.Popen([sys.executable, "-c", CLIENT, endpoint, str(args.model.resolve()), str(args.runs), *pin],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = child.stdout.readline() if child.stdout else ""
        if not line:
            child.wait(60)
            raise SystemExit(f"the client failed:\n{child.stderr.read()[-3000:] if child.stderr else ''}")
        round_trip, own = (float(v) for v in line.split())
        busy = busy_threads(cpu_before, thread_cpu(), clock() - wall_before)
        gc.callbacks.remove(gc_timed)
        # the daemon's own session, run from this thread while the lanes' thread has nothing to do
        direct = []
        for entry in server.service.registry.all():
            for _ in range(args.runs):
                t0 = clock()
                entry.session.run(None, feeds)
                direct.append(clock() - t0)
        child.communicate("\n", timeout=60)
    finally:
        server.request_stop()
        thread.join(30)
    skip = min(200, args.runs // 10)  # the first infers bind and warm up
    print("| model | in-process run | the daemon's session, run from another thread | pass | run_bound | "
          "Session.run | answer | pass - Session.run | daemon's own p50 | the client's round trip |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    med = {k: statistics.median(v[skip:]) * 1e6 for k, v in times.items() if len(v) > skip}
    label = " (run stubbed)" if args.stub_run else " (in-process session kept open)" if args.keep_local else ""
    label += f" (pinned: CPU {lane_cpu}, client {client_cpu})" if args.pin else ""
    print(f"| {args.model.stem}{label} | {in_process:.1f} | {statistics.median(direct[skip:]) * 1e6:.1f} | {med.get('pass', 0):.1f} | {med.get('run_bound', 0):.1f} | "
          f"{med.get('Session.run', 0):.1f} | {med.get('answer', 0):.1f} | "
          f"{med.get('pass', 0) - med.get('Session.run', 0):.1f} | {own:.1f} | {round_trip:.1f} |")
    print("counts: " + ", ".join(f"{k} {len(v)}" for k, v in times.items())
          + f"; the lanes' thread went to sleep {sleeps[0]} times")
    print("garbage collections while the client ran: " + ", ".join(
        f"generation {g}: {len(v)}, {sum(v) * 1e3:.1f} ms in all, {max(v) * 1e6:.0f} µs at most"
        for g, v in sorted(gc_spent.items())))
    print("threads of the daemon's process busy while the client ran (share of a core): "
          + ", ".join(f"{name} {share:.2f}" for name, share in busy))


if __name__ == "__main__":
    main()

"""``python -m bench.cluster``: vkpool on a Ray cluster of two nodes started on this host.

Starts a local Ray cluster (``ray.cluster_utils.Cluster``) of two vkpool nodes, ``a`` and ``b``,
and prints a table of:

- **replicas**: jobs/s (and p50/p99 latency) of a model replicated over both nodes
  (``objective="throughput"``) against the same model on node ``a`` alone, with ``--window``
  requests in flight (``--same-load``: both at twice the window too), a row per
  ``--calls`` setting of the sessions' ``max_bundle`` and ``calls_per_step``;
- **split**: the same for the model split into two pipeline stages, one per node (each node's
  budget below the model, so the planner must split it);
- **hop**: the cost of moving a tensor from node ``a`` to node ``b`` through Ray's object store
  (put on ``a``, pulled by ``b``), per MiB: the slope of a fit over 1–64 MiB; and what the store
  moves from ``a`` to ``b`` with transfers in flight (MiB/s by transfer size), the bound on a
  split whose stages hand each call's tensors over that way;
- with ``--call-cost``, what a call to a node costs the driver by the requests it carries.

After each figure it prints the CPU each thread of the driver and of the nodes' actors used
(``CpuUse``); ``--profile`` samples the driver's Python threads in a run apart (``Sampler``).
Outputs are compared with the single-node session's, and those with onnxruntime's on this
host (``check_reference``). Without ``--gpus`` each node
offers a split of device 0 (``vk0.0``, ``vk0.1``; lavapipe on a machine without GPUs); with
``--gpus`` node ``i`` is given GPU ``i`` as Ray gives GPUs (``num_gpus=1``,
``CUDA_VISIBLE_DEVICES=i``), which its actor maps to the Vulkan device of that UUID.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from bench import workloads
from vkpool.cluster.session import CALLS_PER_STEP, MAX_BUNDLE

NODE_CONFIG = """\
devices:
  - match: {index: 0}
    split: 2
host:
  enabled: false
"""


def start_cluster(gpus: bool, folder: Path) -> Any:
    from ray.cluster_utils import Cluster

    config = folder / "node.yaml"
    config.write_text(NODE_CONFIG)

    def node(i: int) -> dict[str, Any]:
        env = {"VKPOOL_NODE_NAME": "ab"[i]}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        else:
            env.update(VKPOOL_NODE_MEMBERS=f"vk0.{i}", VKPOOL_CONFIG=str(config))
        return dict(num_cpus=2, num_gpus=1 if gpus else 0, resources={"vkpool": 1},
                    object_store_memory=(4 << 30) if gpus else (300 << 20), env_vars=env)

    cluster = Cluster(initialize_head=True, head_node_args=dict(include_dashboard=False, **node(0)))
    cluster.add_node(**node(1))
    cluster.wait_for_nodes()
    return cluster


#: how the bench keeps requests in flight (``--load``): ``callbacks``, each completed request's
#: callback submits the next one (on the session's completion thread: a closed loop that costs
#: the driver no thread hop per request); ``loop``, the main thread submits a new request whenever
#: a semaphore says one completed (a hop from the completion thread to the main thread per request);
#: ``bulk``, one ``session.run_many`` over a stream of requests (its groups: no future per request)
LOADS = ("callbacks", "loop", "bulk")


def assert_outputs(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    """rtol 1e-4, atol 1e-5: float32 on the device."""
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def check_reference(path: Path, feeds: dict[str, np.ndarray], got: list[np.ndarray]) -> None:
    """The cluster's outputs against onnxruntime on this host's CPU: every figure's outputs,
    checked against these, are then right, not only alike."""
    import onnxruntime as ort

    assert_outputs(got, ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds))


def warm_up(session: Any, feeds: dict[str, np.ndarray], want: list[np.ndarray], runs: int) -> None:
    """Checks the session's outputs against ``want`` and runs it ``runs`` times more."""
    assert_outputs(session.run(None, feeds), want)
    for _ in range(runs):
        session.run(None, feeds)


def jobs_per_s(session: Any, feeds: dict[str, np.ndarray], want: list[np.ndarray], seconds: float,
               window: int, load: str = "callbacks", start_at: float | None = None,
               latencies: list[float] | None = None) -> tuple[float, float, float]:
    """(requests completed per second, p50 and p99 latency in seconds) with ``window`` requests
    in flight for about ``seconds``: a new request is submitted as soon as any completes (not
    the oldest: a request done behind a slower one frees its place at once), as ``load`` says
    (:data:`LOADS`). A request's latency is from its submit to its future's completion.
    Outputs are checked before (:func:`warm_up`) and at the end. ``start_at``: the wall-clock
    time (``time.time()``) to start at, so that drivers in several processes measure together
    (the caller warms the session up before); ``latencies`` receives every measured latency."""
    import threading

    if start_at is None:
        warm_up(session, feeds, want, window)
    else:
        time.sleep(max(0.0, start_at - time.time()))
    clock = time.perf_counter
    ended: list[tuple[float, float]] = []  # (completion, latency) of each request
    last: deque[Any] = deque(maxlen=window)
    start = clock()
    deadline = start + seconds
    if load == "callbacks":
        left = [window]
        gate = threading.Lock()
        all_done = threading.Event()
        failed: list[Exception] = []

        def finished(future: Any, submitted: float) -> None:
            now = clock()
            ended.append((now, now - submitted))
            if now < deadline and not failed:
                try:
                    send()
                    return
                except Exception as exc:  # the session refused: stop, and say why below
                    failed.append(exc)
            with gate:
                left[0] -= 1
                if not left[0]:
                    all_done.set()

        def send() -> None:
            future = session.submit(feeds)
            last.append(future)
            future.add_done_callback(lambda f, t=clock(): finished(f, t))

        for _ in range(window):
            send()
        if not all_done.wait(seconds + 300):
            raise TimeoutError("requests still in flight 300 s after the measurement")
        if failed:
            raise failed[0]
    elif load == "loop":
        places = threading.Semaphore(window)

        def freed(_: Any, submitted: float) -> None:
            now = clock()
            ended.append((now, now - submitted))
            places.release()

        while clock() < deadline:
            if not places.acquire(timeout=300):
                raise TimeoutError("no request completed in 300 s")
            future = session.submit(feeds)
            future.add_done_callback(lambda f, t=clock(): freed(f, t))
            last.append(future)
    elif load == "bulk":
        submitted: list[float] = []

        def stream() -> Any:
            while clock() < deadline:
                submitted.append(clock())
                yield feeds

        def ended_one(index: int, result: Any) -> None:
            now = clock()
            if isinstance(result, Exception):
                raise result
            ended.append((now, now - submitted[index]))
            last.append(result)

        session.run_many(stream(), None, ended_one, window=window)
    else:
        raise ValueError(f"load must be one of {', '.join(LOADS)}, got {load!r}")
    for future in last:
        assert_outputs(future if isinstance(future, list) else future.result(timeout=300), want)
    measured = [latency for at, latency in ended if at <= deadline]
    if latencies is not None:
        latencies.extend(measured)
    p50, p99 = np.percentile(measured, [50, 99])
    return len(measured) / seconds, float(p50), float(p99)


def jobs_per_s_drivers(session: Any, options: dict[str, Any], address: str, path: Path,
                       feeds: dict[str, np.ndarray], want: list[np.ndarray], seconds: float, window: int,
                       load: str, drivers: int) -> tuple[float, float, float]:
    """:func:`jobs_per_s` from ``drivers`` processes at once, ``window`` requests in flight in
    all (an even share each): this one with ``session``, and ``drivers - 1`` more
    (``bench.cluster_client``), each with its own session of ``options`` on the same cluster.
    Returns the summed jobs/s and the p50/p99 over every driver's requests."""
    import json
    import subprocess

    if drivers <= 1:
        return jobs_per_s(session, feeds, want, seconds, window, load)
    shares = [window // drivers + (i < window % drivers) for i in range(drivers)]
    spec = path.with_suffix(".client.json")
    wanted = path.with_suffix(".want.npz")
    np.savez(wanted, *want)
    spec.write_text(json.dumps({"address": address, "model": str(path), "options": options,
                                "seconds": seconds, "load": load, "want": str(wanted)}))
    children = [subprocess.Popen([sys.executable, "-m", "bench.cluster_client", str(spec), str(share)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for share in shares[1:]]
    try:
        for child in children:
            line = child.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"a driver process did not start: {line!r}")
        warm_up(session, feeds, want, shares[0])
        start_at = time.time() + 0.5
        for child in children:
            child.stdin.write(f"{start_at}\n")
            child.stdin.flush()
        measured: list[float] = []
        rate = jobs_per_s(session, feeds, want, seconds, shares[0], load, start_at, measured)[0]
        for child in children:
            out, _ = child.communicate(timeout=600)
            if child.returncode:
                raise RuntimeError(f"a driver process failed ({child.returncode})")
            result = json.loads(out.strip().splitlines()[-1])
            rate += result["rate"]
            measured += result["latencies"]
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
    p50, p99 = np.percentile(measured, [50, 99])
    return rate, float(p50), float(p99)


class DriverSplit:
    """Splits the CPU time of a session's request path in the driver (``--split-driver``): the
    answers of calls (with the callbacks they run, which submit the next requests) and the
    starts of calls (packing and Ray's submit), each in the thread's own CPU time."""

    def __init__(self, session: Any) -> None:
        self.session, self.spent = session, {"answer": 0.0, "start": 0.0}
        self.requests = 0

    def _timed(self, label: str, method: Any) -> Any:
        def timed(*args: Any) -> Any:
            begin = time.thread_time()
            try:
                return method(*args)
            finally:
                self.spent[label] += time.thread_time() - begin
        return timed

    def __enter__(self) -> DriverSplit:
        s = self.session
        s._answer, s._start = self._timed("answer", s._answer), self._timed("start", s._start)
        self._served = sum(c["served"] for c in s.copies)
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.session._answer, self.session._start
        self.requests = sum(c["served"] for c in self.session.copies) - self._served

    def report(self) -> str:
        n = max(self.requests, 1)
        return (f"driver CPU per request: answers {self.spent['answer'] / n * 1e6:.1f} µs, call starts "
                f"{self.spent['start'] / n * 1e6:.1f} µs ({self.requests} requests)")


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of each thread of process ``pid`` so far, by thread name
    (threads of one name summed), read from /proc."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return out


class CpuUse:
    """CPU seconds each thread of the driver and of the nodes' actors spends over a measurement."""

    def __init__(self, cluster: Any) -> None:
        self.pids = {"driver": os.getpid(), **{f"node {d['node']}": d["pid"] for d in cluster.describe()}}

    def __enter__(self) -> CpuUse:
        self.before = {who: thread_cpu(pid) for who, pid in self.pids.items()}
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.elapsed = time.perf_counter() - self.start
        self.used = {}
        for who, pid in self.pids.items():
            after = thread_cpu(pid)
            self.used[who] = {n: s - self.before[who].get(n, 0.0) for n, s in after.items()}

    def report(self, label: str) -> str:
        lines = [f"CPU over {self.elapsed:.1f} s, {label} (seconds per second of wall time, per thread):"]
        for who, used in self.used.items():
            shares = ((s / self.elapsed, n) for n, s in used.items())
            busy = sorted(((f, n) for f, n in shares if f >= 0.01), reverse=True)
            total = sum(used.values()) / self.elapsed
            lines.append(f"  {who}: {total:.2f} in all; " + ", ".join(f"{n} {f:.2f}" for f, n in busy[:8]))
        return "\n".join(lines)


def _function(code: Any) -> str:
    return getattr(code, "co_qualname", code.co_name)  # co_qualname: Python 3.11


class Sampler:
    """Where the driver's Python threads are: every ``interval`` seconds, the stack of each
    (``sys._current_frames``; cProfile cannot watch several threads on Python 3.12). A sample
    whose innermost frame is a wait (``Condition.wait``, an executor's idle worker, Ray's error
    listener) is idle;
    the others are busy, or waiting for the interpreter lock, which sampling cannot tell apart.
    Sampling takes the lock for some microseconds a time: run it apart from the figures."""

    IDLE = frozenset({("threading.py", "wait"), ("thread.py", "_worker"),
                      ("worker.py", "listen_error_messages")})

    def __init__(self, interval: float = 0.001) -> None:
        import threading

        self.interval = interval
        self.samples: dict[str, int] = {}
        self.own: dict[tuple[str, str], int] = {}
        self.within: dict[tuple[str, str], int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import threading

        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                thread = names.get(ident, str(ident))
                self.samples[thread] = self.samples.get(thread, 0) + 1
                code = frame.f_code
                if (Path(code.co_filename).name, code.co_name) in self.IDLE:
                    continue
                leaf = (thread, f"{Path(code.co_filename).name}:{frame.f_lineno} {_function(code)}")
                self.own[leaf] = self.own.get(leaf, 0) + 1
                seen = set()
                while frame is not None:
                    code = frame.f_code
                    key = (thread, f"{Path(code.co_filename).name} {_function(code)}")
                    if key not in seen:
                        seen.add(key)
                        self.within[key] = self.within.get(key, 0) + 1
                    frame = frame.f_back

    def report(self, top: int = 15) -> str:
        lines = []
        for thread, total in sorted(self.samples.items(), key=lambda item: -item[1]):
            busy = sum(n for (t, _), n in self.own.items() if t == thread)
            if not busy:
                continue
            lines.append(f"  thread {thread}: busy in {busy / total:.0%} of {total} samples")
            own = sorted(((n, f) for (t, f), n in self.own.items() if t == thread), reverse=True)[:top]
            lines += [f"    own {n / total:6.1%}  {f}" for n, f in own]
            within = sorted(((n, f) for (t, f), n in self.within.items() if t == thread), reverse=True)[:top]
            lines += [f"    in  {n / total:6.1%}  {f}" for n, f in within]
        return "\n".join(lines)


def hop_s_per_mib(cluster: Any) -> tuple[float, float, list[tuple[int, float]]]:
    """(seconds per MiB, fixed seconds, [(MiB, seconds)]) of a tensor put on node a and pulled by b."""
    import ray

    a, b = cluster.actors["a"], cluster.actors["b"]
    points = []
    for mib in (1, 4, 16, 64):
        times = []
        for _ in range(4):
            (ref,) = ray.get(a.put.remote(mib << 20))
            t = time.perf_counter()
            ray.get(b.pull.remote(ref))
            times.append(time.perf_counter() - t)
            del ref
        points.append((mib, min(times[1:])))
    slope, fixed = np.polyfit([p[0] for p in points], [p[1] for p in points], 1)
    return float(slope), float(fixed), points


#: transfers in flight for :func:`hop_throughput` (a split's calls in flight, as a session keeps them)
HOPS_IN_FLIGHT = 8


def hop_throughput(cluster: Any, sizes_mib: tuple[float, ...] = (1, 3.5, 14), seconds: float = 3.0,
                   nodes: tuple[str, str] = ("a", "b")) -> list[tuple[float, float]]:
    """[(MiB, MiB/s)]: tensors put on the first of ``nodes`` and pulled by the second,
    :data:`HOPS_IN_FLIGHT` at a time, for ``seconds`` per size: how much a split's stages can hand
    over through the object store (3.5 MiB is a call of 64 ``conv_many_255MB`` requests cut
    after its first product)."""
    import ray

    a, b = (cluster.actors[n] for n in nodes)
    out = []
    for mib in sizes_mib:
        nbytes = int(mib * (1 << 20))
        ray.get(b.pull.remote(ray.get(a.put.remote(nbytes))[0]))  # warm
        pulls: deque[Any] = deque()
        done, start = 0, time.perf_counter()
        end = start + seconds
        while time.perf_counter() < end or pulls:
            while len(pulls) < HOPS_IN_FLIGHT and time.perf_counter() < end:
                (ref,) = ray.get(a.put.remote(nbytes))  # made on a while earlier ones travel
                pulls.append(b.pull.remote(ref))
            ray.get(pulls.popleft())
            done += 1
        out.append((mib, done * mib / (time.perf_counter() - start)))
    return out


def call_cost(cluster: Any, row_bytes: int, rows: tuple[int, ...] = (1, 16, 31, 33, 64, 128, 256),
              calls: int = 400, in_flight: int = 8) -> list[tuple[int, float, float]]:
    """[(rows, wall seconds per call, driver CPU seconds per call)] of calls to node a's actor
    carrying ``rows`` requests of ``row_bytes`` each (one array, as a packed call carries them),
    ``in_flight`` at a time: what a call costs the driver as it grows past Ray's inline size."""
    import ray

    actor = cluster.actors["a"]
    out = []
    for count in rows:
        blob = np.ones(count * row_bytes, np.uint8)
        ray.get(actor.pull.remote(blob))
        before, start = sum(thread_cpu(os.getpid()).values()), time.perf_counter()
        waiting: deque[Any] = deque()
        for _ in range(calls):
            waiting.append(actor.pull.remote(blob))
            if len(waiting) >= in_flight:
                ray.get(waiting.popleft())
        ray.get(list(waiting))
        wall, cpu = time.perf_counter() - start, sum(thread_cpu(os.getpid()).values()) - before
        out.append((count, wall / calls, cpu / calls))
    return out


def split_budget(cluster: Any, path: Path, member: str) -> int:
    """A budget that holds the larger half of the model's most even two-way cut (5% over what
    the planner prices it at), and not the whole model."""
    from vkpool.partition.plan import chunk_peak_bytes

    from vkpool.placement import balanced_cut

    with cluster.session(path, devices=[member]) as probe:
        whole = probe.placement.memory_bytes[member]
        half = max(chunk_peak_bytes(probe.graph, ops) for ops in balanced_cut(probe.graph, 2))
    return min(int(half * 1.05), whole - 1)


def median_of(figures: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The round whose jobs/s is the median (the lower of the middle two), with its latencies."""
    return sorted(figures)[(len(figures) - 1) // 2]


def figure(measured: tuple[float, float, float]) -> str:
    rate, p50, p99 = measured
    return f"{rate:.1f} ({p50 * 1e3:.2f} / {p99 * 1e3:.2f})"


def member_of(cluster: Any, node: str) -> str:
    return next(m["id"] for m in cluster.members() if m["node"] == node and m["kind"] == "vulkan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", action="store_true", help="one GPU per node (GPU i for node i) instead of "
                        "splits of device 0")
    parser.add_argument("--replicated", default="mnist12_like",
                        help="model of the replicas row (default mnist12_like)")
    parser.add_argument("--split", default=None, help="model of the split row (default: conv_many_255MB with "
                        "--gpus, else mnist12_like)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measuring time per figure (default 5)")
    parser.add_argument("--window", type=int, default=8, help="requests in flight (default 8)")
    parser.add_argument("--calls", nargs="+", default=[f"autox{CALLS_PER_STEP}"],
                        metavar="BUNDLExCALLS",
                        help="the sessions' max_bundle and calls_per_step, one table row per pair; BUNDLE "
                        f"'auto' leaves max_bundle unset (up to {MAX_BUNDLE}, as many as travel inside Ray's "
                        f"call) (default autox{CALLS_PER_STEP}, the defaults)")
    parser.add_argument("--figures", nargs="+", choices=("replicas", "split", "hop"),
                        default=["replicas", "split", "hop"],
                        help="which figures to measure (default all three)")
    parser.add_argument("--split-driver", action="store_true", help="after each two-node figure, run it "
                        "again for --seconds, timing the session's answers and call starts in the driver")
    parser.add_argument("--drivers", type=int, nargs="+", default=[1],
                        help="driver processes sending at once, each with its own session and an even "
                        "share of --window, a table row per count (default 1: this process alone)")
    parser.add_argument("--shared", action="store_true", help="the drivers' sessions share one set of "
                        "copies (a session name), instead of each opening its own")
    parser.add_argument("--load", nargs="+", choices=LOADS, default=["callbacks"],
                        help="how requests are kept in flight, a table row per choice (default callbacks; "
                        "see LOADS)")
    parser.add_argument("--same-load", action="store_true", help="measure one and two nodes with twice "
                        "--window too (two nodes then have as many requests in flight per node as one node "
                        "at --window), and the ratio of the best figures of each (what each serves at most)")
    parser.add_argument("--rounds", type=int, default=1, help="measure one node and two nodes this many "
                        "times each, in turn (one node first in even rounds, two nodes first in odd ones), "
                        "and give each one's median round and the range of the rounds' ratios (default 1)")
    parser.add_argument("--call-cost", action="store_true", help="also measure what a call to a node costs "
                        "the driver by the requests it carries (of the replicated model's input size)")
    parser.add_argument("--profile", action="store_true", help="after each two-node figure, run it again "
                        "for --seconds, sampling the driver's Python threads, and print where they are")
    args = parser.parse_args(argv)
    split_model = args.split or ("conv_many_255MB" if args.gpus else "mnist12_like")
    try:
        settings = [(None if bundle == "auto" else int(bundle), int(calls))
                    for bundle, calls in (spec.split("x") for spec in args.calls)]
    except ValueError:
        parser.error(f"--calls takes BUNDLExCALLS pairs such as 64x4, got {' '.join(args.calls)}")

    import vkpool.cluster
    from vkpool.cluster.links import node_of

    folder = Path(tempfile.mkdtemp(prefix="vkpool-bench-cluster-"))
    os.environ.setdefault("VKPOOL_CACHE_DIR", str(folder / "cache"))
    ray_cluster = start_cluster(args.gpus, folder)
    rows: list[tuple[str, ...]] = []
    try:
        with vkpool.cluster.connect(ray_cluster.address) as cluster:
            a, b = member_of(cluster, "a"), member_of(cluster, "b")
            budgets = {m["id"]: m["budget_bytes"] for m in cluster.members()}
            listed = ", ".join(f"{m['id']} ({m['name']})" for m in cluster.members())
            print(f"nodes: {listed}")
            for kind, name in (("replicas", args.replicated), ("split", split_model)):
                if kind not in args.figures:
                    continue
                path = workloads.save(name, folder)
                feeds = workloads.input_for(name)
                for row, ((bundle, calls), load, drivers) in enumerate(
                        itertools.product(settings, args.load, args.drivers)):
                    calling = {"max_bundle": bundle, "calls_per_step": calls}
                    shared = (lambda which: {"name": f"bench-{kind}-{row}-{which}"}) if args.shared else (
                        lambda which: {})
                    how = f"{bundle or 'auto'}x{calls}, {load}, {drivers} driver(s)"
                    shown = [""]

                    def measure_one(first: bool) -> tuple[Any, Any, int]:
                        with cluster.session(path, devices=[a], **calling, **shared("one")) as one:
                            want = one.run(None, feeds)
                            check_reference(path, feeds, want)
                            wanted[:] = want
                            with CpuUse(cluster) as cpu:
                                single = jobs_per_s_drivers(one, {"devices": [a], **calling, **shared("one")},
                                                            ray_cluster.address, path, feeds, want, args.seconds,
                                                            args.window, load, drivers)
                            single2 = (jobs_per_s_drivers(one, {"devices": [a], **calling, **shared("one")},
                                                          ray_cluster.address, path, feeds, want, args.seconds,
                                                          2 * args.window, load, drivers) if args.same_load else None)
                            bundled = one._max_bundle
                        if first:
                            print(cpu.report(f"{kind} {name} on node a, {how}"))
                        return single, single2, bundled

                    def measure_two(first: bool) -> tuple[Any, Any, int]:
                        if kind == "replicas":
                            given: dict[str, Any] = {"objective": "throughput", "devices": [a, b]}
                        else:  # budgets under the model on each node: the planner must cut it in two
                            cap = split_budget(cluster, path, a)
                            given = {"objective": "throughput", "budgets": {a: cap, b: cap}}
                        given.update(shared("two"))
                        try:
                            with cluster.session(path, **given, **calling) as two:
                                plan = two.placement
                                bundled_two = two._max_bundle
                                copies = ", ".join([plan.chunks[0].member, *plan.replicas])
                                shown[0] = (f"replicas on {copies}" if plan.replicas
                                            else " → ".join(c.member for c in plan.chunks))
                                if len({node_of(m) for c in plan.chunks for m in [c.member, *plan.replicas]}) < 2:
                                    raise RuntimeError(f"the {kind} plan does not span both nodes: {shown[0]}")
                                if first and not plan.replicas:
                                    print(f"{kind} {name}: " + "; ".join(
                                        f"{c.member} {c.ops[0]} … {c.ops[-1]} ({len(c.ops)} ops, predicted compute "
                                        f"{c.compute_ps / 1e6:.1f} µs, {c.upload_bytes} B in, {c.download_bytes} B out)"
                                        for c in plan.chunks))
                                want = wanted or two.run(None, feeds)
                                with CpuUse(cluster) as cpu:
                                    both = jobs_per_s_drivers(two, {**given, **calling}, ray_cluster.address,
                                                              path, feeds, want, args.seconds, args.window, load,
                                                              drivers)
                                if first:
                                    print(cpu.report(f"{kind} {name} on both nodes, {how}"))
                                doubled = (jobs_per_s_drivers(two, {**given, **calling}, ray_cluster.address, path,
                                                              feeds, want, args.seconds, 2 * args.window, load,
                                                              drivers) if args.same_load else None)
                                if first and args.split_driver:
                                    with DriverSplit(two) as split:
                                        jobs_per_s(two, feeds, want, args.seconds, args.window, load)
                                    print(f"{kind} {name} on both nodes, {how}: {split.report()}")
                                if first and args.profile:
                                    with Sampler() as sampler:
                                        jobs_per_s(two, feeds, want, args.seconds, args.window, load)
                                    print(f"driver's Python threads, {kind} {name} on both nodes, {how} (a run "
                                          f"apart, sampled every ms; a share of samples):\n{sampler.report()}")
                        finally:
                            for member in (a, b):
                                cluster.set_budget(member, budgets[member])
                        return both, doubled, bundled_two

                    wanted: list[np.ndarray] = []
                    ones, twos = [], []
                    for r in range(args.rounds):  # one node first, then two; the other way round next
                        if r % 2 == 0:
                            ones.append(measure_one(r == 0))
                            twos.append(measure_two(r == 0))
                        else:
                            twos.append(measure_two(False))
                            ones.append(measure_one(False))
                    single, single2, bundled = median_of([o[0] for o in ones]), None, ones[0][2]
                    both, doubled = median_of([t[0] for t in twos]), None
                    ratios = [t[0][0] / o[0][0] for o, t in zip(ones, twos)]
                    if args.same_load:
                        single2, doubled = median_of([o[1] for o in ones]), median_of([t[1] for t in twos])
                        ratios = [max(t[0][0], t[1][0]) / max(o[0][0], o[1][0]) for o, t in zip(ones, twos)]
                    spread = (f" ({min(ratios):.2f}–{max(ratios):.2f} over {len(ratios)} rounds)"
                              if len(ratios) > 1 else "")
                    rows.append((f"{kind}: {name}", f"{bundle or f'auto ({bundled} one, {twos[0][2]} two)'}x{calls}", load,
                                 f"{drivers}{' shared' if args.shared else ''}", figure(single),
                                 figure(both), f"{both[0] / single[0]:.2f}", shown[0])
                                + ((figure(single2), figure(doubled), f"{doubled[0] / single2[0]:.2f}",
                                    f"{max(both[0], doubled[0]) / max(single[0], single2[0]):.2f}{spread}")
                                   if doubled else ()))
                    if not args.same_load and spread:
                        rows[-1] = (*rows[-1][:6], f"{both[0] / single[0]:.2f}{spread}", *rows[-1][7:])
                    print("row: | " + " | ".join(rows[-1]) + " |", flush=True)
            slope, fixed, points = hop_s_per_mib(cluster) if "hop" in args.figures else (0.0, 0.0, [])
            streamed = hop_throughput(cluster) if "hop" in args.figures else []
            row_bytes = sum(v.nbytes for v in workloads.input_for(args.replicated).values())
            costs = call_cost(cluster, row_bytes) if args.call_cost else []
    finally:
        ray_cluster.shutdown()
    if rows:
        print(f"\nwindow {args.window}, {args.seconds:g} s per figure; jobs/s (p50 / p99 latency in ms)")
        more = ((f" one node, window {2 * args.window} | two nodes, window {2 * args.window} | two / one "
                 "there | best two / best one |", "---|---|---|---|") if args.same_load else ("", ""))
        print(f"| figure | max_bundle x calls_per_step | load | drivers | one node | two nodes | two / one | "
              f"plan |{more[0]}\n|---|---|---|---|---|---|---|---|{more[1]}")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    if points:
        print(f"\nhop a → b through the object store: {slope * 1e3:.2f} ms per MiB + {fixed * 1e3:.2f} ms "
              f"({', '.join(f'{m} MiB {s * 1e3:.1f} ms' for m, s in points)})")
    if streamed:
        print(f"hops a → b with {HOPS_IN_FLIGHT} in flight: "
              + ", ".join(f"{m:g} MiB {rate:.0f} MiB/s ({rate / m:.0f} a second)" for m, rate in streamed))
    if costs:
        print(f"\ncalls to node a, 8 in flight, requests of {row_bytes} B each (one array per call):\n"
              "| requests per call | KiB | wall µs per call | driver CPU µs per call | per request |\n"
              "|---|---|---|---|---|")
        for count, wall, cpu in costs:
            print(f"| {count} | {count * row_bytes / 1024:.0f} | {wall * 1e6:.0f} | {cpu * 1e6:.0f} | "
                  f"{cpu * 1e6 / count:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

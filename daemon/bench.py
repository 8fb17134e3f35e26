"""What the daemon costs: latency through it against in-process, and jobs/s with many clients.

    python -m vkpool.daemon.bench [MODEL ...] [--runs 2000] [--seconds 5] [--clients 1 4 16]
                                  [--transport zmq|lane|both] [--out FILE.json]

MODEL is an ONNX file or a workload name of ``bench/workloads.py`` (run from the repository root
for those; default: ``mnist12_like add_chain_1``). The bench starts its own daemon on a temporary
ipc socket with the same config as the in-process sessions (``--config``, else the default), so
both run on the same member. Jobs reach the daemon over ZeroMQ (``zmq``), on the local lane
(``lane``), or both (the default), each through a client of its own. Latency is measured by one
client thread in rounds that alternate in-process and daemon runs, so that a change of machine
load hits all alike; *added* is a transport's median minus the in-process median. Throughput
counts the jobs that N client processes, started together, complete in ``--seconds``. The
markdown table goes to stdout; ``--out`` also writes the figures as JSON (and the table beside
it, as ``.md``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

DEFAULT_MODELS = ("mnist12_like", "add_chain_1")
TRANSPORTS = ("zmq", "lane")
_ROUNDS = 10

_CLIENT = """
import json, sys, time, numpy as np
from vkpool.daemon.client import Client
endpoint, model, seconds, lane = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4] == "lane"
load_options, warmup = json.loads(sys.argv[5]), float(sys.argv[6])
with Client(endpoint, local_lane=lane) as client:
    if client.local_lane != lane:
        raise SystemExit("the daemon offers no local lane")
    session = client.session(model, **load_options)
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(i.dtype)
             for i in session.get_inputs()}
    for _ in range(20):
        session.run(None, feeds)
    sys.stdout.write("ready\\n"); sys.stdout.flush()
    sys.stdin.readline()
    lat, clock = [], time.perf_counter
    end = clock() + warmup  # the same load, unmeasured: the devices' clocks rise to it
    while clock() < end:
        session.run(None, feeds)
    cpu0 = time.process_time()
    end = clock() + seconds
    while True:
        t0 = clock()
        if t0 >= end:
            break
        session.run(None, feeds)
        lat.append(clock() - t0)
    cpu = time.process_time() - cpu0
    lat = np.sort(np.asarray(lat)) * 1e6
    keep = lat[np.linspace(0, len(lat) - 1, min(len(lat), 2000)).astype(int)] if len(lat) else lat
    print(json.dumps({"jobs": len(lat), "cpu_s": cpu, "latency_us": [round(float(v), 1) for v in keep]}))
"""


def resolve_model(name: str, folder: Path, symbolic_batch: bool = False) -> Path:
    """An existing ONNX file, or a workload of ``bench/workloads.py`` written into ``folder``
    (with a symbolic batch dim when ``symbolic_batch``)."""
    path = Path(name)
    if path.suffix == ".onnx" or path.exists():
        if not path.is_file():
            raise SystemExit(f"{name}: no such model file")
        return path.resolve()
    try:
        from bench import workloads
    except ImportError:
        raise SystemExit(f"{name!r} is not a file, and the workload builders (bench/workloads.py) cannot be "
                         "imported: run from the repository root, or pass .onnx files") from None
    if not symbolic_batch:
        return workloads.save(name, folder).resolve()
    import onnx

    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.onnx"
    onnx.save_model(workloads.symbolic_batch(workloads.build(name)), out)
    return out.resolve()


def feeds_for(inputs: list[Any]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(i.dtype)
            for i in inputs}


def summary_us(times_s: list[float]) -> dict[str, float]:
    p05, p50, p95 = np.percentile(np.array(times_s) * 1e6, [5, 50, 95])
    return {"median_us": round(float(p50), 1), "p05_us": round(float(p05), 1), "p95_us": round(float(p95), 1),
            "runs": len(times_s)}


def interleaved_latency(runs: dict[str, Callable[[], Any]], total: int, warmup: int = 50) -> dict[str, list[float]]:
    """Per-call seconds of each function, measured in alternating rounds of ``total / _ROUNDS`` calls."""
    for run in runs.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    per_round = max(1, total // _ROUNDS)
    clock = time.perf_counter
    for _ in range(_ROUNDS):
        for name, run in runs.items():
            out = times[name]
            for _ in range(per_round):
                t = clock()
                run()
                out.append(clock() - t)
    return times


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds a process has used so far (Linux ``/proc``), 0.0 elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(endpoint: str | list[str], model: Path, clients: int, seconds: float, transport: str = "zmq",
               load_options: dict[str, Any] | None = None, daemon_pid: int | list[int] | None = None,
               on_start: Callable[[], Any] | None = None, warmup: float = 0.0) -> dict[str, float]:
    """Jobs per second completed by ``clients`` processes running together over ``transport``, with
    the p50 and p99 of their latencies (each client's latencies subsampled to 2000, pooled), and
    the CPU the clients (together) and the daemon (``daemon_pid``) used meanwhile, in cores. The
    clients first run ``warmup`` seconds unmeasured. ``on_start`` is called as the measured
    seconds start. With several endpoints (and daemons), the clients are dealt to them in turn."""
    endpoints = [endpoint] if isinstance(endpoint, str) else endpoint
    pids = [] if daemon_pid is None else [daemon_pid] if isinstance(daemon_pid, int) else daemon_pid
    procs = [subprocess.Popen([sys.executable, "-c", _CLIENT, endpoints[i % len(endpoints)], str(model), str(seconds),
                               transport, json.dumps(load_options or {}), str(warmup)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for i in range(clients)]
    try:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a bench client exited {p.wait()} before it was ready")
        for p in procs:  # start together
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        time.sleep(warmup)
        daemon_cpu = sum(cpu_seconds(pid) for pid in pids)
        if on_start is not None:
            on_start()
        answers = [json.loads(p.communicate(timeout=seconds + 120)[0].strip().splitlines()[-1]) for p in procs]
        daemon_cpu = sum(cpu_seconds(pid) for pid in pids) - daemon_cpu
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    pooled = np.concatenate([np.asarray(a["latency_us"]) for a in answers])
    p50, p99 = np.percentile(pooled, [50, 99]) if pooled.size else (0.0, 0.0)
    result = {"jobs_per_s": round(sum(a["jobs"] for a in answers) / seconds, 1), "p50_us": round(float(p50), 1),
              "p99_us": round(float(p99), 1), "clients_cpu": round(sum(a["cpu_s"] for a in answers) / seconds, 2)}
    if pids:
        result["daemon_cpu"] = round(daemon_cpu / seconds, 2)
    return result


def batched(status: Callable[[], dict[str, Any]], run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run()``'s figures, with the mean batch size of the batches the daemon ran meanwhile
    (``mean_batch``, from ``status()`` before and after) where its models batch."""
    def counts() -> tuple[int, int]:
        stats = [m["batching"] for m in status().get("models", []) if m.get("batching")]
        return sum(b["batches"] for b in stats), sum(b["requests"] for b in stats)

    before = counts()
    result = run()
    batches, requests = (a - b for a, b in zip(counts(), before))
    if batches:
        result["mean_batch"] = round(requests / batches, 2)
    return result


def spread(status: Callable[[], dict[str, Any]], run: Callable[[Callable[[], Any]], dict[str, Any]]
           ) -> dict[str, Any]:
    """``run(on_start)``'s figures; on a daemon with a serving process per device, with the
    clients each process had as the run started (``clients_by_process``, the bench's own
    connection included)."""
    seen: list[int] = []

    def on_start() -> None:
        seen.extend(p["clients"] for p in status().get("processes", []))

    result = run(on_start)
    if seen:
        result["clients_by_process"] = seen
    return result


class BenchDaemon:
    """``vkpool serve`` on a temporary ipc socket, its log kept for failures."""

    def __init__(self, config: str | None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="vkb", dir="/tmp"))  # ipc paths: at most 107 bytes
        self.endpoint = f"ipc://{self.folder}/bench.sock"
        self.log = open(self.folder / "daemon.log", "wb")
        cmd = [sys.executable, "-m", "vkpool", *(["--config", config] if config else []),
               "serve", "--endpoint", self.endpoint]
        self.proc = subprocess.Popen(cmd, stderr=self.log)

    def client(self, local_lane: bool | None = None) -> Any:
        from vkpool.daemon.client import Client
        from vkpool.daemon.errors import DaemonUnavailable

        deadline = time.monotonic() + 60
        while True:
            try:
                return Client(self.endpoint, hello_timeout=2, local_lane=local_lane)
            except DaemonUnavailable:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.log.flush()
                    raise RuntimeError("the bench daemon did not start:\n"
                                       + (self.folder / "daemon.log").read_text()[-3000:]) from None
                time.sleep(0.2)

    def pids(self) -> list[int]:
        """The daemon's processes: its own, and its serving processes with ``process_per_device``."""
        with self.client(local_lane=False) as client:
            serving = (client.front or {}).get("serving") or []
        return [self.proc.pid, *(p["pid"] for p in serving if p["pid"])]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def measure(models: list[Path], *, config: str | None, runs: int, seconds: float,
            clients: list[int], transports: tuple[str, ...] = TRANSPORTS,
            batching: dict[str, Any] | None = None, objective: str | None = None,
            warmup: float = 0.0) -> dict[str, Any]:
    """Per model: the in-process latency, each transport's latency and added time, and jobs/s."""
    from contextlib import ExitStack

    from vkpool.session import Session

    load = {**(batching or {}), **({"objective": objective} if objective else {})}  # load_model's options
    daemon = BenchDaemon(config)
    results: dict[str, Any] = {}
    try:
        with ExitStack() as stack:
            via = {t: stack.enter_context(daemon.client(local_lane=t == "lane")) for t in transports}
            if "lane" in via and not via["lane"].local_lane:
                raise RuntimeError("the bench daemon offers no local lane")
            names = {m["id"]: m.get("name", "") for m in next(iter(via.values())).devices()}
            for path in models:
                with Session(str(path), config=config) as local:
                    feeds = feeds_for(local.get_inputs())
                    remote = {t: client.session(path, **load) for t, client in via.items()}
                    runners = {"in_process": lambda: local.run(None, feeds)}
                    for t, session in remote.items():
                        runners[t] = lambda session=session: session.run(None, feeds)
                    times = interleaved_latency(runners, runs)
                    member = local.member.id
                    for session in remote.values():
                        session.close()
                base = summary_us(times["in_process"])
                entry: dict[str, Any] = {"member": member, "device": names.get(member, ""), "in_process": base}
                for t in transports:
                    entry[t] = summary_us(times[t])
                entry["added_us"] = {t: round(entry[t]["median_us"] - base["median_us"], 1) for t in transports}
                status = next(iter(via.values())).status
                pids = daemon.pids()
                entry["throughput"] = {t: {str(n): batched(status, lambda n=n, t=t, path=path: spread(
                    status, lambda on_start: throughput(daemon.endpoint, path, n, seconds, t, load, pids, on_start,
                                                        warmup)))
                    for n in clients} for t in transports}
                entry["jobs_per_s"] = {t: {n: r["jobs_per_s"] for n, r in by.items()}
                                       for t, by in entry["throughput"].items()}
                results[path.stem] = entry
                print(f"{path.stem}: added at the median (us) {entry['added_us']}; jobs/s {entry['jobs_per_s']}",
                      file=sys.stderr)
    finally:
        daemon.stop()
    return results


def environment() -> dict[str, Any]:
    import zmq

    from vkpool import __version__

    return {"vkpool": __version__, "python": platform.python_version(), "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "system": f"{platform.system()} {platform.release()}"}


_NAMES = {"zmq": "ZeroMQ", "lane": "local lane"}


def to_markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    transports = report["transports"]
    cells = "".join(f" {_NAMES[t]} median / p05 / p95 (µs) | added, {_NAMES[t]} (µs) |" for t in transports)
    lines = [f"`{report['command']}`", "",
             f"vkpool {env['vkpool']}, Python {env['python']}, pyzmq {env['pyzmq']} (libzmq {env['libzmq']}), "
             f"{env['cpus']} CPUs; {report['runs']} runs per latency, {report['seconds']:g} s per throughput "
             "figure.", "",
             "| model | device | in-process median / p05 / p95 (µs) |" + cells,
             "|---|---|---|" + "---|---|" * len(transports)]
    for name, r in report["models"].items():
        a = r["in_process"]
        device = f"{r['member']} ({r['device']})" if r["device"] else r["member"]
        row = f"| {name} | {device} | {a['median_us']:.0f} / {a['p05_us']:.0f} / {a['p95_us']:.0f} |"
        for t in transports:
            d = r[t]
            row += f" {d['median_us']:.0f} / {d['p05_us']:.0f} / {d['p95_us']:.0f} | {r['added_us'][t]:.0f} |"
        lines.append(row)
    counts = report["clients"]
    batching = report.get("batching") or {}
    if report.get("objective", "latency") != "latency":
        lines += ["", f"Models loaded for {report['objective']} (`--objective`)."]
    if batching:
        lines += ["", f"Batching: max_batch {batching['max_batch']}, max_queue_delay "
                      f"{batching.get('max_queue_delay', 0) * 1e6:g} µs."]
    lines += ["", "CPU: cores busy in the daemon / in the clients together, while they ran"
                  + ("; batch: the mean size of the batches run meanwhile." if batching else "."),
              "", "| model | transport | " + " | ".join(f"{n} client{'s' if n > 1 else ''}: jobs/s (p50 / p99 µs; "
                                                          "CPU)" for n in counts) + " |",
              "|---|---|" + "---|" * len(counts)]
    for name, r in report["models"].items():
        for t in transports:
            cells = []
            for n in counts:
                f = r["throughput"][t][str(n)]
                cpu = f"; {f['daemon_cpu']:.2f} / {f['clients_cpu']:.2f}" if "daemon_cpu" in f else ""
                cpu += f"; batch {f['mean_batch']:.1f}" if "mean_batch" in f else ""
                cpu += f"; clients {'+'.join(map(str, f['clients_by_process']))}" if "clients_by_process" in f else ""
                cells.append(f"{f['jobs_per_s']:.0f} ({f['p50_us']:.0f} / {f['p99_us']:.0f}{cpu})")
            lines.append(f"| {name} | {_NAMES[t]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vkpool.daemon.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=list(DEFAULT_MODELS),
                        help="ONNX files or workload names (default: mnist12_like add_chain_1)")
    parser.add_argument("--config", help="config file for the pool (in-process and daemon alike)")
    parser.add_argument("--runs", type=int, default=2000, help="latency samples per path and model")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput figure")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="client process counts")
    parser.add_argument("--transport", choices=[*TRANSPORTS, "both"], default="both",
                        help="how jobs reach the daemon: ZeroMQ, the local lane, or both (default)")
    parser.add_argument("--max-batch", type=int, metavar="N",
                        help="load the models with dynamic batching up to N rows (workload names are then "
                             "exported with a symbolic batch dim)")
    parser.add_argument("--max-delay-us", type=float, default=0.0, metavar="US",
                        help="with --max-batch: how long a batch's first request may wait for company")
    parser.add_argument("--objective", choices=["latency", "throughput"],
                        help="load the models for this objective (throughput: a copy on every member that holds "
                             "one; see `vkpool load --objective`)")
    parser.add_argument("--warmup", type=float, default=1.0, metavar="SECONDS",
                        help="before each throughput figure, the clients run this long unmeasured, so that the "
                             "devices' clocks have risen to the load (default 1)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON (and the table as .md)")
    args = parser.parse_args(argv)
    if args.max_batch is not None and args.max_batch < 1 or args.max_delay_us < 0:
        parser.error("--max-batch must be at least 1 and --max-delay-us at least 0")
    if args.max_delay_us and args.max_batch is None:
        parser.error("--max-delay-us needs --max-batch")
    if min(args.clients) < 1 or args.runs < 1 or args.seconds <= 0:
        parser.error("--clients, --runs and --seconds must be positive")
    if args.warmup < 0:
        parser.error("--warmup must be at least 0")
    batching = None if args.max_batch is None else {"max_batch": args.max_batch,
                                                    "max_queue_delay": args.max_delay_us * 1e-6}
    work = Path(tempfile.mkdtemp(prefix="vkpool-bench-"))
    try:
        models = [resolve_model(m, work, symbolic_batch=batching is not None) for m in args.models]
        transports = TRANSPORTS if args.transport == "both" else (args.transport,)
        figures = measure(models, config=args.config, runs=args.runs, seconds=args.seconds, clients=args.clients,
                          transports=transports, batching=batching, objective=args.objective,
                          warmup=args.warmup)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    command = "python -m vkpool.daemon.bench " + " ".join(argv if argv is not None else sys.argv[1:])
    report = {"command": command.strip(), "environment": environment(), "runs": args.runs,
              "seconds": args.seconds, "clients": args.clients, "transports": list(transports), "models": figures,
              "batching": batching, "objective": args.objective or "latency", "warmup": args.warmup}
    table = to_markdown(report)
    sys.stdout.write(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        args.out.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

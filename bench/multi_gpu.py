"""Multi-member execution on this machine's pool: splits, replicas, and a GPU + software device.

Run on a machine with two GPUs (vkpool installed from source)::

    python -m bench.multi_gpu --out multi_gpu.json

It uses the pool's Vulkan members: the first two that are not software devices are "the GPUs";
a software device (llvmpipe) if the pool has one, else the ``cpu`` member, is "the host side".

- (a) ``conv_many_255MB`` and ``matmul_1GB_16layers`` split over the two GPUs by budgets (each
  budget holds about half the model, so neither GPU holds it alone), planned with the latency
  and with the throughput objective: latency against the whole model on one GPU, and
  throughput with 8 requests in flight against one GPU;
- (b) ``mnist12_like`` and ``conv_few_15MB`` replicated on both GPUs (the throughput objective):
  throughput with 8 requests in flight against one GPU, with the replicas run by threads of
  this process and by one worker process each (``Session(processes=...)``);
- (a) is measured with the chunks run by threads of this process and by one worker process
  each (``Session(processes=...)``); ``--in-place`` has the workers' devices write and read
  the tensors crossing between chunks in the shared request slots themselves;
- every throughput figure follows a second of the same load, unmeasured (``WARMUP_S``), and
  comes with this process's CPU time per request;
- one GPU's throughput is the best of a session on it (each request run as it is submitted),
  the executor running the whole model as one chunk there (two runs on the device at once)
  and that chunk in a worker process;
- (c) one GPU + the host side in one plan: outputs against ONNX Runtime (CPU), and the time of
  each chunk (member, ops, median ms).

Prints markdown; ``--out`` writes the same figures as JSON. ``--smoke`` runs on one device split
into three members (two stand in for the GPUs, the third for the host side) with the large
workloads scaled down, to check the script end to end anywhere.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench import workloads
from bench.stats import median_run_s

PARTS = ("split", "replicated", "mixed")
#: seconds of the same load run before each throughput figure: the GPUs' clocks rise under a
#: sustained load and fall while they idle (see docs/benchmarks.md, "the GPU's clock"), and one
#: GPU and the split must be measured in the same state
WARMUP_S = 1.0
#: requests a throughput figure keeps outstanding (``--in-flight``)
IN_FLIGHT = 8
#: worker processes read and write the tensors crossing chunks in the shared slots (``--in-place``)
IN_PLACE = False
SMOKE_CONFIG = ("devices:\n  - match: {index: 0}\n    split: 3\n    budget: [600MiB, 600MiB, 600MiB]\n"
                "host:\n  enabled: true\n  budget: 1GiB\n")


def _smoke_models() -> dict[str, Callable[[], Any]]:
    # the large workloads' structure at smaller widths: lavapipe on a few cores runs them in seconds
    return {
        "conv_many_255MB": lambda: workloads._conv_net("conv_many_scaled", [16, 32, 64], [2, 2, 1],
                                                       [3136, 1024, 1024, 512, 10]),
        "matmul_1GB_16layers": lambda: workloads._matmul_net("matmul_16layers_scaled", 1024, 16),
    }


def _model(name: str, smoke: bool) -> tuple[bytes, dict[str, np.ndarray]]:
    build = _smoke_models().get(name) if smoke else None
    proto = build() if build is not None else workloads.build(name)
    feeds = workloads.input_for(name)
    if smoke and name == "matmul_1GB_16layers":
        feeds = {"x": np.random.default_rng(0).standard_normal((1, 1024), dtype=np.float32)}
    return proto.SerializeToString(), feeds


def _label(name: str, smoke: bool) -> str:
    return f"{name} (scaled)" if smoke and name in _smoke_models() else name


def roles(pool: Any) -> tuple[list[str], str]:
    """(the two GPU member ids, the host-side member id) of ``pool``."""
    vulkan = pool.vulkan_members
    software = [m for m in vulkan if m.info.type == "cpu"]
    gpus = [m.id for m in vulkan if m.info.type != "cpu"]
    if len(gpus) < 2:  # a split software device (the smoke run): its first members stand in
        gpus = [m.id for m in vulkan][:2]
        software = [m for m in vulkan if m.id not in gpus]
    if len(gpus) < 2:
        raise SystemExit(f"two Vulkan members are needed; the pool has {[m.id for m in vulkan]}")
    host = software[0].id if software else "cpu"
    return gpus, host


def latency_ms(session: Any, feeds: dict[str, np.ndarray], runs: int) -> float:
    return median_run_s(lambda: session.run(None, feeds), runs, warmup=min(3, runs)) * 1e3


def throughput(session: Any, feeds: dict[str, np.ndarray], requests: int, in_flight: int | None = None,
               warmup_s: float | None = None, stats: dict[str, Any] | None = None) -> float:
    """Requests per second with ``in_flight`` requests kept outstanding (futures; a new one as
    the oldest completes), after ``warmup_s`` (default ``WARMUP_S``) of the same load unmeasured.
    ``stats``, when given, gets this process's CPU time per request (all its threads) and the
    processor this thread and the session's worker processes were last seen on."""
    in_flight = IN_FLIGHT if in_flight is None else in_flight
    deadline = time.perf_counter() + (WARMUP_S if warmup_s is None else warmup_s)
    _requests_per_s(session, feeds, in_flight, in_flight)
    while time.perf_counter() < deadline:
        _requests_per_s(session, feeds, max(in_flight, requests // 4), in_flight)
    before = resource.getrusage(resource.RUSAGE_SELF)
    per_s = _requests_per_s(session, feeds, requests, in_flight)
    if stats is not None:
        after = resource.getrusage(resource.RUSAGE_SELF)
        stats["caller_cpu_us"] = round((after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
                                       / requests * 1e6, 1)
        stats["placement"] = placement(session)
    return per_s


def _cpu_of(stat_path: str) -> str | None:
    """``cpuN/socketS`` for the task whose ``/proc/.../stat`` this is (Linux only)."""
    try:
        with open(stat_path) as f:
            cpu = int(f.read().rsplit(")", 1)[1].split()[36])
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id") as f:
            return f"cpu{cpu}/socket{f.read().strip()}"
    except (OSError, ValueError, IndexError):
        return None


def placement(session: Any) -> dict[str, Any]:
    """Where the calling thread and the session's worker processes last ran."""
    out: dict[str, Any] = {"caller": _cpu_of(f"/proc/self/task/{threading.get_native_id()}/stat")}
    workers = getattr(session.executor, "workers", None) or []
    out["workers"] = {f"{w.stage.index}@{w.member.id}": _cpu_of(f"/proc/{w.proc.pid}/stat") for w in workers}
    return out


def _requests_per_s(session: Any, feeds: dict[str, np.ndarray], requests: int, in_flight: int) -> float:
    """A closed loop: ``in_flight`` requests outstanding, the next submitted as soon as the
    oldest one's result is in (each ``result()`` waited for by this one thread)."""
    window: deque = deque()
    t0 = time.perf_counter()
    for _ in range(requests):
        if len(window) >= in_flight:
            window.popleft().result()
        window.append(session.submit(feeds))
    while window:
        window.popleft().result()
    return requests / (time.perf_counter() - t0)


def one_gpu_throughput(pool: Any, gpu: str, model: bytes, feeds: dict[str, np.ndarray], requests: int,
                       one: Any, process: bool = False) -> dict[str, float]:
    """One GPU's throughput every way it can run: ``one`` (a session on the GPU, whose
    ``submit`` runs each request before returning), the executor with the whole model as one
    chunk on it (two runs on the device at once, as each stage of a split has) and, with
    ``process``, that chunk in a worker process (as each replica runs with ``processes``).
    The best of them is the baseline the ratios use."""
    from vkpool.partition.graph import build_graph
    from vkpool.session import Session

    out = {"one_gpu_direct_per_s": throughput(one, feeds, requests)}
    whole = {op: gpu for op in build_graph(one.model).nodes}
    with Session(model, pool=pool, plan=whole, processes=False) as queued:
        out["one_gpu_queued_per_s"] = throughput(queued, feeds, requests)
    if process:
        with Session(model, pool=pool, plan=whole, processes=True, in_place=IN_PLACE) as worker:
            out["one_gpu_process_per_s"] = throughput(worker, feeds, requests)
    out["one_gpu_per_s"] = max(out.values())
    return out


def _graph(session: Any) -> Any:
    from vkpool.partition.graph import build_graph

    return build_graph(session.model)


def _gpu_us(chunk: Any) -> float | None:
    """A Vulkan chunk's GPU time (timestamps around its dispatches, median of five), µs; None
    for a host chunk or one in a worker process."""
    commands = getattr(chunk, "commands", None)
    if commands is None:
        return None
    return statistics.median(sum(chunk.device.profile(commands)) for _ in range(5))


def _split_row(split: Any, feeds: dict[str, np.ndarray], expected: list[np.ndarray], runs: int,
               requests: int) -> dict[str, Any]:
    out = split.run(None, feeds)
    row: dict[str, Any] = dict(
        members=sorted({c.member for c in split.plan.chunks}),
        chunks=[{"member": c.member, "ops": len(c.ops)} for c in split.plan.chunks],
        transfers=[{"tensor": t.tensor, "bytes": t.nbytes, "src": t.src, "dst": t.dst}
                   for t in split.plan.transfers],
        identical=all(np.array_equal(a, b) for a, b in zip(out, expected)),
        split_ms=latency_ms(split, feeds, runs),
    )
    # each chunk's time in those one-at-a-time runs (inputs written to outputs read), and its
    # GPU time: the slower stage bounds what the pipeline can give
    row["stage_ms"] = [statistics.median(e.ms for e in split.trace() if e.chunk == c.index)
                       for c in split.plan.chunks]
    row["stage_gpu_us"] = [_gpu_us(stage.chunk) for stage in split.executor.copies[0].stages]
    row["split_per_s"] = throughput(split, feeds, requests, stats=row)
    row["in_place"] = getattr(split.executor, "in_place", None)
    return row


def split_by_budgets(pool: Any, gpus: list[str], name: str, smoke: bool, runs: int, requests: int,
                     cut: str | None = None) -> dict:
    """The splits the planner makes, with each objective, under budgets that each hold about
    half the model (products too large for them divided into column blocks,
    :mod:`vkpool.column_split`); with ``cut``, also the plan that puts the ops before ``cut``
    (graph order) on the first GPU and the rest on the second, given, without budgets. Each
    plan is measured given (:func:`_both_ways`); a throughput-objective plan equal to the
    latency one is not measured twice."""
    from vkpool.partition.plan import chunk_peak_bytes
    from vkpool.placement import balanced_cut
    from vkpool.session import Session

    model, feeds = _model(name, smoke)
    saved = {m: pool.member(m).budget_bytes for m in gpus}
    with Session(model, pool=pool, device=gpus[0]) as one:
        expected = one.run(None, feeds)
        row: dict[str, Any] = {"workload": _label(name, smoke), "one_gpu_ms": latency_ms(one, feeds, runs),
                               "one_gpu_gpu_us": _gpu_us(one._chunk),
                               **one_gpu_throughput(pool, gpus[0], model, feeds, requests, one, process=True)}
        whole = sum(one.memory_by_member().values())
        graph = _graph(one)
    halves = balanced_cut(graph, 2)
    need = max(chunk_peak_bytes(graph, ops) for ops in halves)
    budget = min(whole - 1, need + need // 20 + (1 << 20))
    row.update(budget_bytes=budget, whole_bytes=whole, plans=[])
    try:
        for m in gpus:
            pool.set_budget(m, budget)
        made: list[dict[str, str]] = []
        for objective in ("latency", "throughput"):
            with Session(model, pool=pool, devices=gpus, processes=False, objective=objective) as planned:
                placed = dict(planned.plan.member_of)
            if placed not in made:
                made.append(placed)
                row["plans"].append(_both_ways(model, pool, feeds, expected, runs, requests,
                                               f"budgets, {objective} objective", placed))
    finally:
        for m in gpus:
            pool.set_budget(m, saved[m])
    if cut is not None:
        order = graph.graph["order"]
        at = order.index(cut)
        assignment = {op: gpus[0] if i < at else gpus[1] for i, op in enumerate(order)}
        row["plans"].append(_both_ways(model, pool, feeds, expected, runs, requests, f"given, cut at {cut}",
                                       assignment))
    return row


def _both_ways(model: Any, pool: Any, feeds: dict[str, np.ndarray], expected: list[np.ndarray], runs: int,
               requests: int, how: str, plan: dict[str, str]) -> dict[str, Any]:
    """``plan`` (op → member; a divided product's blocks named as the planner names them) run by
    threads of this process and by a worker process per chunk."""
    from vkpool.session import Session

    measured: dict[str, Any] = {"how": how}
    for processes, key in ((False, "threads"), (True, "processes")):
        with Session(model, pool=pool, plan=plan, processes=processes, in_place=IN_PLACE and processes) as split:
            measured["column_splits"] = split.model.column_splits
            measured[key] = _split_row(split, feeds, expected, runs, requests)
    return measured


def replicated(pool: Any, gpus: list[str], name: str, smoke: bool, requests: int) -> dict:
    from vkpool.session import Session

    model, feeds = _model(name, smoke)
    with Session(model, pool=pool, device=gpus[0]) as one:
        expected = one.run(None, feeds)
        row: dict[str, Any] = {"workload": name,
                               **one_gpu_throughput(pool, gpus[0], model, feeds, requests, one, process=True)}
    for processes, key in ((False, "threads"), (True, "processes")):
        with Session(model, pool=pool, devices=gpus, objective="throughput", processes=processes,
                     in_place=IN_PLACE and processes) as both:
            out = both.run(None, feeds)
            row[key] = dict(replicas=list(both.plan.replicas), copies=len(both.executor.copies),
                            identical=all(np.array_equal(a, b) for a, b in zip(out, expected)))
            row[key]["per_s"] = throughput(both, feeds, requests, stats=row[key])
            row[key]["in_place"] = getattr(both.executor, "in_place", None)
            row[key]["requests_per_copy"] = {copy: sum(1 for e in both.trace() if e.copy == copy and e.chunk == 0)
                                             for copy in range(len(both.executor.copies))}
    return row


def gpu_and_host(pool: Any, gpu: str, host: str, name: str, smoke: bool, runs: int) -> dict:
    import onnxruntime as ort

    from vkpool.placement import balanced_cut
    from vkpool.session import Session

    model, feeds = _model(name, smoke)
    with Session(model, pool=pool, device=gpu) as probe:
        graph = _graph(probe)
    first, second = balanced_cut(graph, 2)
    assignment = {**{op: gpu for op in first}, **{op: host for op in second}}
    ref = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    with Session(model, pool=pool, plan=assignment) as session:
        out = session.run(None, feeds)
        for _ in range(runs):
            session.run(None, feeds)
        events = session.trace()
        table = []
        for chunk in session.plan.chunks:
            times = [e.ms for e in events if e.chunk == chunk.index]
            table.append({"chunk": chunk.index, "member": chunk.member, "ops": len(chunk.ops),
                          "ms": statistics.median(times)})
        return {"workload": name, "members": [gpu, host],
                "max_abs_diff_vs_onnxruntime": max(float(np.max(np.abs(a - b))) for a, b in zip(out, ref)),
                "allclose": all(np.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in zip(out, ref)),
                "chunks": table}


def _table(title: str, header: list[str], rows: list[list[Any]], note: str = "") -> list[str]:
    return [title, "", *([note, ""] if note else []), "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows), ""]


def _us(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _one_gpu(row: dict) -> str:
    """The baseline, with each way of running one GPU beside it."""
    ways = [(k[len("one_gpu_"):-len("_per_s")], v) for k, v in row.items()
            if k.startswith("one_gpu_") and k.endswith("_per_s") and k != "one_gpu_per_s"]
    return f"{row['one_gpu_per_s']:.1f} (" + ", ".join(f"{k} {v:.0f}" for k, v in ways) + ")"


def _mode(mode: str, row: dict[str, Any]) -> str:
    """How the chunks ran: threads, or processes reading the shared slots in place or copying."""
    if mode != "processes":
        return mode
    return "processes, in place" if row.get("in_place") else "processes, copying"


def _placed(where: dict[str, Any] | None) -> str:
    if not where:
        return "—"
    return f"caller {where['caller']}; " + ", ".join(f"{k} {v}" for k, v in where["workers"].items())


def markdown(result: dict) -> str:
    n = result["in_flight"]
    lines = [f"# Multi-member execution ({result['device']})", "",
             f"GPUs: {', '.join(result['gpus'])}; host side: {result['host']}" + (" (smoke)" if result["smoke"] else ""),
             ""]
    if "split" in result:
        rows = []
        for r in result["split"]:
            for plan in r["plans"]:
                how = plan["how"]
                for mode in ("threads", "processes"):
                    x = plan[mode]
                    rows.append([r["workload"], how, _mode(mode, x), "+".join(x["members"]), x["identical"],
                                 f"{r['one_gpu_ms']:.3f} ms", f"{x['split_ms']:.3f} ms", _us(r.get("one_gpu_gpu_us")),
                                 " + ".join(_us(t) for t in x["stage_gpu_us"]), _one_gpu(r),
                                 f"{x['split_per_s']:.1f}", f"{x['split_per_s'] / r['one_gpu_per_s']:.2f}×",
                                 x.get("caller_cpu_us", "—")])
        lines += _table("## (a) Split over two GPUs",
                        ["workload", "plan", "chunks run in", "members", "identical", "1 GPU latency",
                         "split latency", "1 GPU, GPU µs", "stages, GPU µs", f"1 GPU req/s ({n} in flight)", "split req/s",
                         "ratio", "caller CPU µs/req"], rows)
    if "replicated" in result:
        lines += _table("## (b) Replicated on both GPUs",
                        ["workload", "replicas run in", "replicas", "identical", f"1 GPU req/s ({n} in flight)",
                         "replicated req/s", "ratio", "requests per copy", "caller CPU µs/req", "placement"],
                        [[r["workload"], _mode(how, r[how]), ", ".join(r[how]["replicas"]) or "none", r[how]["identical"],
                          _one_gpu(r), f"{r[how]['per_s']:.1f}",
                          f"{r[how]['per_s'] / r['one_gpu_per_s']:.2f}×", r[how]["requests_per_copy"],
                          r[how].get("caller_cpu_us", "—"), _placed(r[how].get("placement"))]
                         for r in result["replicated"] for how in ("threads", "processes")])
    if "gpu_and_host" in result:
        c = result["gpu_and_host"]
        lines += _table(f"## (c) One GPU + {result['host']} in one plan: {c['workload']}",
                        ["chunk", "member", "ops", "median ms"],
                        [[row["chunk"], row["member"], row["ops"], f"{row['ms']:.3f}"] for row in c["chunks"]],
                        note=f"max |vkpool − ONNX Runtime CPU| = {c['max_abs_diff_vs_onnxruntime']:.3g} "
                             f"(allclose rtol 1e-3, atol 1e-5: {c['allclose']})")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    global WARMUP_S, IN_FLIGHT, IN_PLACE
    parser = argparse.ArgumentParser(prog="python -m bench.multi_gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="pool config (default: $VKPOOL_CONFIG or the packaged default)")
    parser.add_argument("--smoke", action="store_true",
                        help="one device split in three members, large workloads scaled down")
    parser.add_argument("--runs", type=int, default=None, help="timed runs per latency (default 50; smoke 5)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per throughput figure (default 2000; smoke 16)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS),
                        help="which figures: split (a), replicated (b), mixed (c); default all")
    parser.add_argument("--workloads", nargs="+", default=None,
                        help="only these workloads of the parts asked for (default: each part's own)")
    parser.add_argument("--warmup-s", type=float, default=None,
                        help=f"seconds of load before each throughput figure (default {WARMUP_S}; smoke 0)")
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT,
                        help=f"requests each throughput figure keeps outstanding (default {IN_FLIGHT})")
    parser.add_argument("--in-place", action="store_true",
                        help="worker processes' devices write and read the tensors crossing between chunks in the "
                             "shared slots themselves instead of the workers copying them (Session(in_place=True))")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    IN_FLIGHT = args.in_flight
    IN_PLACE = args.in_place
    WARMUP_S = args.warmup_s if args.warmup_s is not None else 0.0 if args.smoke else WARMUP_S
    from vkpool.config.loader import parse_config
    from vkpool.pool import DevicePool

    runs = args.runs or (5 if args.smoke else 50)
    requests = args.requests or (16 if args.smoke else 2000)
    pool = DevicePool.from_config(parse_config(SMOKE_CONFIG) if args.smoke else args.config)
    try:
        gpus, host = roles(pool)
        device = ", ".join(sorted({pool.member(g).info.name for g in gpus}))
        result: dict[str, Any] = {"device": device, "gpus": gpus, "host": host, "smoke": args.smoke,
                                  "runs": runs, "requests": requests, "in_flight": IN_FLIGHT}
        def chosen(names: tuple[str, ...]) -> list[str]:
            return [n for n in names if args.workloads is None or n in args.workloads]

        if "split" in args.parts:
            # conv_many_255MB: also cut after its convolutions, where GPU time splits evenly
            # (the budgets' split puts the convolutions with the largest dense layer)
            result["split"] = [split_by_budgets(pool, gpus, n, args.smoke, runs, requests,
                                                cut="Reshape33" if n == "conv_many_255MB" else None)
                               for n in chosen(("conv_many_255MB", "matmul_1GB_16layers"))]
        if "replicated" in args.parts:
            result["replicated"] = [replicated(pool, gpus, n, args.smoke, requests)
                                    for n in chosen(("mnist12_like", "conv_few_15MB"))]
        if "mixed" in args.parts:
            result["gpu_and_host"] = gpu_and_host(pool, gpus[0], host, "conv_few_15MB", args.smoke, runs)
    finally:
        pool.close()
    return report(result, markdown(result), args.out)


def report(result: dict, text: str, out: Path | None) -> int:
    """Prints ``text`` (markdown) and, with ``out``, writes ``result`` there as JSON; returns 0."""
    sys.stdout.write(text)
    if out:
        out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

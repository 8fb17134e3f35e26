"""One measurement in its own process: ``python -m bench.child MODE ...`` writes a JSON result.

Modes:
- ``probe``: can the runtime run here? (``status`` ok or unavailable)
- ``latency``: load, check the first output against the reference (the correctness gate), then
  time ``runs`` calls after ``warmup`` calls (the first call is one of the warm-up calls).
- ``footprint``: load, run twice, exit; the parent measures wall time and peak RSS of this process.

A fresh process per measurement keeps runtimes from sharing allocators, threads or drivers, and
lets a crashing runtime be reported as failed instead of ending the harness.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from bench.runners import RUNNERS, RunnerOptions, Unavailable
from bench.stats import check_output, summarize


def _latency(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from bench.workloads import input_for

    runner = RUNNERS[args.runtime](RunnerOptions(device=args.device, endpoint=args.endpoint))
    feed = input_for(args.workload)
    t0 = time.perf_counter()
    run = runner.load(Path(args.model), args.workload)
    result["load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter_ns()
    y = run(feed)
    result["first_run_ms"] = (time.perf_counter_ns() - t0) / 1e6
    gate = check_output(y, np.load(args.ref))
    result["gate"] = gate.to_dict()
    if not gate.ok:
        result["status"], result["reason"] = "wrong", gate.reason
        return
    for _ in range(max(args.warmup - 1, 0)):
        run(feed)
    samples: list[int] = []
    gc.disable()  # a collection inside a timed call is the harness's noise, not the runtime's
    try:
        for _ in range(args.runs):
            t0 = time.perf_counter_ns()
            run(feed)
            samples.append(time.perf_counter_ns() - t0)
    finally:
        gc.enable()
    result["latency"] = summarize(samples).to_dict()
    result["samples_ms"] = [s / 1e6 for s in samples]
    result["status"] = "ok"


def _footprint(args: argparse.Namespace, result: dict[str, Any]) -> None:
    from bench.workloads import input_for

    runner = RUNNERS[args.runtime](RunnerOptions(device=args.device, endpoint=args.endpoint))
    feed = input_for(args.workload)
    t0 = time.perf_counter()
    run = runner.load(Path(args.model), args.workload)
    result["load_s"] = time.perf_counter() - t0
    run(feed)
    run(feed)
    result["peak_rss_mib"] = peak_rss_mib()
    result["status"] = "ok"


def peak_rss_mib() -> float:
    """Peak resident set of this process since its exec.

    VmHWM belongs to the process's own address space; the rusage of a child reaped by the parent
    would also count the parent's pages when the child was spawned with vfork, as Python does.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.child")
    parser.add_argument("mode", choices=["probe", "latency", "footprint"])
    parser.add_argument("--runtime", required=True, choices=sorted(RUNNERS))
    parser.add_argument("--result", required=True, type=Path)
    parser.add_argument("--workload")
    parser.add_argument("--model")
    parser.add_argument("--ref")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--device")
    parser.add_argument("--endpoint")
    args = parser.parse_args(argv)

    result: dict[str, Any] = {"runtime": args.runtime, "workload": args.workload, "mode": args.mode}
    try:
        if args.mode == "probe":
            detail = RUNNERS[args.runtime](RunnerOptions(device=args.device, endpoint=args.endpoint)).probe()
            result["status"], result["detail"] = "ok", detail or ""
        elif args.mode == "latency":
            _latency(args, result)
        else:
            _footprint(args, result)
    except Unavailable as exc:
        result["status"], result["reason"] = "unavailable", str(exc)
    except Exception as exc:  # any runtime failure is a result to report, not a harness crash
        result["status"], result["reason"] = "failed", f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    args.result.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``python -m bench`` (``make bench``): run the benchmark protocol of docs/benchmarks.md.

Writes to ``--out`` (default ``bench/out/``): ``results.json`` (every number, with the per-run
samples), ``results.md`` (the tables), ``bench-latency.png`` and ``bench-add-chain.png``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench import workloads as wl
from bench.harness import Config, run_all
from bench.report import plot, render_markdown
from bench.runners import RUNNERS

SMOKE_WORKLOADS = ["mnist12_like", "mlp", "conv_few_15MB"]
SMOKE_NS = (1, 10, 100)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="quick check: mnist12_like, mlp, conv_few_15MB, add chains N=1,10,100; 3 warm-up + 10 runs")
    parser.add_argument("--workloads", nargs="+", metavar="NAME",
                        help=f"workloads to run (default: all). Known: {', '.join(wl.all_names())}; "
                             "any add_chain_<N> works; 'add_chain' means the protocol's five lengths")
    parser.add_argument("--runtimes", nargs="+", metavar="NAME", choices=list(RUNNERS),
                        help=f"runtimes to run (default: all): {', '.join(RUNNERS)}")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                        help="output folder (default: bench/out/)")
    parser.add_argument("--device", help="vkpool device id for the in-process runtime")
    parser.add_argument("--warmup", type=int, help="warm-up runs (default 20; smoke 3)")
    parser.add_argument("--runs", type=int, help="timed runs (default 100; smoke 10)")
    parser.add_argument("--append", action="store_true",
                        help="keep the results already in --out for the (runtime, workload) pairs not run now, "
                             "so a long benchmark can be run in parts")
    parser.add_argument("--timeout", type=float, help="seconds per child process (default 900; smoke 120)")
    return parser.parse_args(argv)


def select_workloads(requested: list[str] | None, smoke: bool) -> list[str]:
    if not requested:
        ns = SMOKE_NS if smoke else wl.ADD_CHAIN_NS
        return (SMOKE_WORKLOADS if smoke else list(wl.WORKLOADS)) + [f"add_chain_{n}" for n in ns]
    names: list[str] = []
    for name in requested:
        expanded = [f"add_chain_{n}" for n in (SMOKE_NS if smoke else wl.ADD_CHAIN_NS)] if name == "add_chain" else [name]
        for item in expanded:
            wl.input_for(item)  # raises KeyError with the known names for a typo
            names.append(item)
    return list(dict.fromkeys(names))


def merge(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` plus the results of ``old`` for the (runtime, workload) pairs ``new`` did not measure."""
    fresh = {(r["runtime"], r["workload"]) for r in new["results"]}
    kept = [r for r in old["results"] if (r["runtime"], r["workload"]) not in fresh]
    merged = dict(new)
    merged["results"] = kept + new["results"]
    merged["elapsed_s"] = old.get("elapsed_s", 0.0) + new.get("elapsed_s", 0.0)
    merged["runtimes"] = {**old.get("runtimes", {}), **new.get("runtimes", {})}
    available = set(merged["runtimes"])
    merged["unavailable"] = {rt: why for rt, why in {**old.get("unavailable", {}), **new.get("unavailable", {})}.items()
                             if rt not in available or rt in new.get("unavailable", {})}
    for key in ("workloads", "runtimes"):
        merged["config"][key] = list(dict.fromkeys(old.get("config", {}).get(key, []) + new["config"][key]))
    return merged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        workloads = select_workloads(args.workloads, args.smoke)
    except KeyError as exc:
        print(f"python -m bench: {exc.args[0]}", file=sys.stderr)
        return 2
    cfg = Config(
        workloads=workloads,
        runtimes=args.runtimes or list(RUNNERS),
        out=args.out,
        warmup=args.warmup if args.warmup is not None else (3 if args.smoke else 20),
        runs=args.runs if args.runs is not None else (10 if args.smoke else 100),
        timeout_s=args.timeout if args.timeout is not None else (120.0 if args.smoke else 900.0),
        device=args.device,
        smoke=args.smoke,
    )
    doc = run_all(cfg)
    cfg.out.mkdir(parents=True, exist_ok=True)
    previous = cfg.out / "results.json"
    if args.append and previous.exists():
        doc = merge(json.loads(previous.read_text()), doc)
    (cfg.out / "results.json").write_text(json.dumps(doc, indent=1))
    markdown = render_markdown(doc)
    (cfg.out / "results.md").write_text(markdown + "\n")
    images = plot(doc, cfg.out)
    print(markdown)
    written = [cfg.out / "results.json", cfg.out / "results.md", *images]
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

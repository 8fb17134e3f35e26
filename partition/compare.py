"""Greedy (VKML first-fit) against the DP on the benchmark workloads, as a Markdown table.

Run from the repository root (``bench.workloads`` builds the models)::

    python -m vkpool.partition.compare [--spec partition/specs/2xh200.yaml] [names ...]

Each workload is planned on four identical members (the first member of ``--spec``) whose
budget is the smallest that lets the DP fit the model on k = 2, 3, 4 members: ``peak / k``
grown by 5 % steps until a plan exists, so k members are needed (k−1 do not suffice at the
starting budget). Greedy gets the same members; it is charged as VKML charges, and may fail.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vkpool.partition.algorithms import dp_partition, greedy_partition
from vkpool.partition.cost import Member, load_device_spec, specs_dir
from vkpool.partition.graph import build_graph
from vkpool.partition.plan import PartitionUnfeasible, chunk_peak_bytes
from vkpool.units import format_size

DEFAULT_WORKLOADS = ["mnist12_like", "mlp", "conv_few_15MB", "conv_many_255MB", "matmul_1GB_16layers"]


def _members(template: Member, count: int, budget: int) -> list[Member]:
    return [Member(f"gpu{k}", budget, template.cost, template.kind) for k in range(count)]


def compare(name: str, template: Member, ks: tuple[int, ...] = (2, 3, 4)) -> list[dict]:
    sys.path.insert(0, str(Path.cwd()))
    from bench import workloads

    from vkpool.model import load_model

    G = build_graph(load_model(workloads.build(name)))
    peak = chunk_peak_bytes(G, G.graph["order"])
    rows = []
    for k in ks:
        budget = peak // k
        while True:
            members = _members(template, 4, budget)
            try:
                dp_lat = dp_partition(G, members, objective="latency")
                dp_thr = dp_partition(G, members, objective="throughput", replicate=False)
                break
            except PartitionUnfeasible:
                budget = int(budget * 1.05) + 1
        try:
            greedy = greedy_partition(G, members)
        except PartitionUnfeasible:
            greedy = None
        rows.append({"workload": name, "k": k, "budget": budget, "ops": len(G), "greedy": greedy,
                     "dp_latency": dp_lat, "dp_throughput": dp_thr})
    return rows


def _cell(plan, what: str) -> str:
    if plan is None:
        return "fails"
    if what == "chunks":
        return str(len(plan.chunks))
    if what == "bytes":
        return format_size(plan.transfer_bytes)
    if what == "latency":
        return f"{plan.latency_s * 1e3:.3f}"
    if what == "throughput":
        return f"{plan.throughput_per_s:.0f}"
    return f"{plan.solve_time_s * 1e3:.1f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b else ("1.00×" if a == b else "∞")


def table(rows: list[dict]) -> str:
    head = ("| workload | ops | k (budget from peak/k) | budget each | greedy chunks / DP | greedy moved / DP | "
            "latency ms greedy / DP (ratio) | throughput /s greedy / DP (ratio) | solve ms greedy / DP |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        g, dl, dt = r["greedy"], r["dp_latency"], r["dp_throughput"]
        lat = f"{_cell(g, 'latency')} / {_cell(dl, 'latency')}"
        thr = f"{_cell(g, 'throughput')} / {_cell(dt, 'throughput')}"
        if g is not None:
            lat += f" ({_ratio(g.latency_s, dl.latency_s)})"
            thr += f" ({_ratio(dt.throughput_per_s, g.throughput_per_s)})"
        lines.append(f"| {r['workload']} | {r['ops']} | {r['k']} | {format_size(r['budget'])} | "
                     f"{_cell(g, 'chunks')} / {_cell(dl, 'chunks')} | {_cell(g, 'bytes')} / {_cell(dl, 'bytes')} | "
                     f"{lat} | {thr} | {_cell(g, 'solve')} / {_cell(dl, 'solve')} |")
    return "\n".join(lines) + "\n"


def dp_never_worse(rows: list[dict]) -> list[str]:
    """Rows where greedy beat the DP (an empty list is the claim of docs/partitioning.md)."""
    bad = []
    for r in rows:
        g = r["greedy"]
        if g is None:
            continue
        if g.latency_s < r["dp_latency"].latency_s * (1 - 1e-9):
            bad.append(f"{r['workload']} k={r['k']}: greedy latency better")
        if g.throughput_per_s > r["dp_throughput"].throughput_per_s * (1 + 1e-9):
            bad.append(f"{r['workload']} k={r['k']}: greedy throughput better")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", default=DEFAULT_WORKLOADS)
    parser.add_argument("--spec", default=str(specs_dir() / "2xh200.yaml"),
                        help="device spec whose first member is copied four times")
    args = parser.parse_args(argv)
    template = load_device_spec(args.spec)[0]
    rows = [row for name in args.names for row in compare(name, template)]
    sys.stdout.write(table(rows))
    bad = dp_never_worse(rows)
    print("\nDP never worse than greedy:", "yes" if not bad else "NO: " + "; ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

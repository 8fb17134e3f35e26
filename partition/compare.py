"""Greedy (VKML first-fit) against the DP on the benchmark workloads and five model graphs.

Run from the repository root (``bench.workloads`` builds the workloads,
:mod:`vkpool.partition.model_shapes` the model graphs)::

    python -m vkpool.partition.compare [--spec partition/specs/2xh200.yaml] [names ...]

For k = 2, 3, 4 identical members (copies of the first member of ``--spec``), each model gets
the smallest budget, within 1 %, at which the DP fits it on k members, and the smallest at which
greedy does (bisections between the largest single op and everything the model touches); the
``needs`` figure is the fewest members the DP fits the model on at its budget: k when that
budget forces k members. Both algorithms then plan on k members at the larger of the two budgets.
Prints a Markdown table and the key ratios, and fails (AssertionError) if greedy beats the DP on
latency or throughput on any row.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import networkx as nx
import numpy as np

from vkpool.partition.algorithms import dp_partition, greedy_partition
from vkpool.partition.cost import Member, load_device_spec, specs_dir
from vkpool.partition.graph import build_graph
from vkpool.partition.plan import PartitionUnfeasible, _never_freed_bytes, chunk_peak_bytes
from vkpool.units import format_size

DEFAULT_WORKLOADS = ["mnist12_like", "mlp", "conv_few_15MB", "conv_many_255MB", "matmul_1GB_16layers",
                     "bert_base_seq128", "gpt2_small_seq128", "resnet50", "mobilenetv2", "unet_small"]


def _members(template: Member, count: int, budget: int) -> list[Member]:
    return [Member(f"gpu{k}", budget, template.cost, template.kind) for k in range(count)]


def load_graph(name: str) -> nx.DiGraph:
    """The op graph of a model graph of :mod:`~vkpool.partition.model_shapes` or a bench workload."""
    from vkpool.model import load_model
    from vkpool.partition import model_shapes

    if name in model_shapes.MODELS:
        return build_graph(load_model(model_shapes.build(name)))
    sys.path.insert(0, str(Path.cwd()))
    from bench import workloads

    return build_graph(load_model(workloads.build(name)))


def _fits(G: nx.DiGraph, template: Member, count: int, budget: int, algorithm: str = "dp") -> bool:
    members = _members(template, count, budget)
    try:
        if algorithm == "dp":
            dp_partition(G, members, objective="latency")
        else:
            greedy_partition(G, members)
        return True
    except PartitionUnfeasible:
        return False


def smallest_budget(G: nx.DiGraph, template: Member, k: int, algorithm: str = "dp") -> int:
    """The smallest budget (within 1 %) at which ``algorithm`` fits ``G`` on ``k`` members, by
    bisection between the largest single op and twice everything the model touches, never freed
    (greedy charges a staging copy of every large output and re-read input, sent or not)."""
    order = G.graph["order"]
    lo = max(chunk_peak_bytes(G, [op]) for op in order) - 1
    hi = 2 * _never_freed_bytes(G, order)
    while hi - lo > max(1, hi // 100):
        mid = (lo + hi) // 2
        if _fits(G, template, k, mid, algorithm):
            hi = mid
        else:
            lo = mid
    return hi


def compare(name: str, template: Member, ks: tuple[int, ...] = (2, 3, 4)) -> list[dict]:
    """Per k: the smallest budgets of the DP and of greedy on k members, and both plans at the larger."""
    G = load_graph(name)
    rows = []
    for k in ks:
        dp_budget = smallest_budget(G, template, k)
        needs = next(j for j in range(1, k + 1) if _fits(G, template, j, dp_budget))
        greedy_budget = smallest_budget(G, template, k, "greedy")
        # greedy may fit below the DP's smallest budget (it can give a member several chunks, outside
        # the DP's one segment per member): compare where both have a plan
        budget = max(dp_budget, greedy_budget)
        members = _members(template, k, budget)
        rows.append({"workload": name, "k": k, "needs": needs, "dp_budget": dp_budget,
                     "greedy_budget": greedy_budget, "budget": budget,
                     "ops": len(G), "greedy": greedy_partition(G, members),
                     "dp_latency": dp_partition(G, members, objective="latency"),
                     "dp_throughput": dp_partition(G, members, objective="throughput", replicate=False)})
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
    head = ("| model | ops | k | DP's smallest budget (needs) | greedy's smallest budget (× DP's) | "
            "chunks greedy / DP | moved greedy / DP | latency ms greedy / DP (ratio) | "
            "throughput /s greedy / DP (ratio) | solve ms greedy / DP |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        g, dl, dt = r["greedy"], r["dp_latency"], r["dp_throughput"]
        lat = f"{_cell(g, 'latency')} / {_cell(dl, 'latency')} ({_ratio(g.latency_s, dl.latency_s)})"
        thr = f"{_cell(g, 'throughput')} / {_cell(dt, 'throughput')} ({_ratio(dt.throughput_per_s, g.throughput_per_s)})"
        lines.append(f"| {r['workload']} | {r['ops']} | {r['k']} | {format_size(r['dp_budget'])} ({r['needs']}) | "
                     f"{format_size(r['greedy_budget'])} ({_ratio(r['greedy_budget'], r['dp_budget'])}) | "
                     f"{_cell(g, 'chunks')} / {_cell(dl, 'chunks')} | {_cell(g, 'bytes')} / {_cell(dl, 'bytes')} | "
                     f"{lat} | {thr} | {_cell(g, 'solve')} / {_cell(dl, 'solve')} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    """The key ratios over every row (geometric mean, min, max)."""
    forced = sum(r["needs"] == r["k"] for r in rows)
    lines = [f"{len(rows)} rows; at the DP's smallest budget the model needs all k members on {forced}"]
    figures = [
        ("budget greedy needs / DP needs", [r["greedy_budget"] / r["dp_budget"] for r in rows]),
        ("latency greedy / DP", [r["greedy"].latency_s / r["dp_latency"].latency_s for r in rows]),
        ("throughput DP / greedy", [r["dp_throughput"].throughput_per_s / r["greedy"].throughput_per_s for r in rows]),
        ("bytes moved greedy / DP (rows where both move some)",
         [r["greedy"].transfer_bytes / r["dp_latency"].transfer_bytes for r in rows
          if r["greedy"].transfer_bytes and r["dp_latency"].transfer_bytes]),
        ("chunks greedy / DP", [len(r["greedy"].chunks) / len(r["dp_latency"].chunks) for r in rows]),
    ]
    alone = sum(r["dp_latency"].transfer_bytes == 0 < r["greedy"].transfer_bytes for r in rows)
    lines.append(f"- the DP moves nothing while greedy moves tensors on {alone} rows (one member holds it all)")
    for label, values in figures:
        if not values:
            continue
        geo = float(np.exp(np.mean(np.log(values))))
        lines.append(f"- {label}: geometric mean {geo:.2f}×, min {min(values):.2f}×, max {max(values):.2f}×")
    return "\n".join(lines) + "\n"


def greedy_wins(rows: list[dict]) -> list[tuple[str, bool]]:
    """Rows where greedy beat the DP: what it won, and whether greedy's plan lies in the DP's
    space (each member runs one chunk; the DP is optimal only over those plans)."""
    won = []
    for r in rows:
        g = r["greedy"]
        inside = len({c.member for c in g.chunks}) == len(g.chunks)
        if g.latency_s < r["dp_latency"].latency_s * (1 - 1e-9):
            won.append((f"{r['workload']} k={r['k']}: greedy latency better", inside))
        if g.throughput_per_s > r["dp_throughput"].throughput_per_s * (1 + 1e-9):
            won.append((f"{r['workload']} k={r['k']}: greedy throughput better", inside))
    return won


def dp_never_worse(rows: list[dict]) -> list[str]:
    """Rows where greedy, with a plan in the DP's space, beat it (an empty list is the claim of
    docs/partitioning.md; greedy plans that run a member several times may win)."""
    return [what for what, inside in greedy_wins(rows) if inside]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", default=DEFAULT_WORKLOADS)
    parser.add_argument("--spec", default=str(specs_dir() / "2xh200.yaml"),
                        help="device spec whose first member is copied four times")
    args = parser.parse_args(argv)
    template = load_device_spec(args.spec)[0]
    rows = []
    for name in args.names:
        print(f"planning {name} ...", file=sys.stderr, flush=True)
        rows += compare(name, template)
    sys.stdout.write(table(rows) + "\n" + summary(rows))
    bad = dp_never_worse(rows)
    outside = [what for what, inside in greedy_wins(rows) if not inside]
    print("\nDP never worse than greedy where greedy runs each member once:",
          "yes" if not bad else "NO: " + "; ".join(bad))
    if outside:
        print("greedy better with a member run several times (outside the DP's space): " + "; ".join(outside))
    if bad:
        raise AssertionError("greedy beat the DP: " + "; ".join(bad))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

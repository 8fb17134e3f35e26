"""``vkpool devices --cluster`` and ``vkpool plan --cluster``: the cluster's pool and its plans."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def is_spec_file(target: str) -> bool:
    """Whether ``--cluster`` names a cluster spec file rather than a Ray address."""
    return target.endswith((".yaml", ".yml")) and Path(target).is_file()


def cmd_devices(args: argparse.Namespace) -> int:
    """Every node's members with their budgets and use, and each node's link."""
    from vkpool.cluster import connect
    from vkpool.units import format_size

    with connect(args.cluster) as cluster:
        nodes = cluster.describe()
    if args.json:
        print(json.dumps({"cluster": args.cluster, "nodes": nodes,
                          "members": [{**m, "id": f"{d['node']}/{m['id']}", "node": d["node"]}
                                      for d in nodes for m in d["members"]]}, indent=2))
        return 0
    rows: list[tuple[Any, ...]] = [("MEMBER", "DEVICE", "KIND", "BUDGET", "USED", "FREE")]
    for d in nodes:
        for m in d["members"]:
            rows.append((f"{d['node']}/{m['id']}", m["name"], m["kind"], format_size(m["budget_bytes"]),
                         format_size(m["used_bytes"]), format_size(m["free_bytes"])))
    _table(rows)
    print("\nLinks (through Ray's object store, as the planner prices them):")
    for d in nodes:
        link = d["link"] or {}
        print(f"  {d['node']:<12} {link.get('bytes_per_s', 0) / 2**20:10.1f} MiB/s   "
              f"latency {link.get('latency_s', 0) * 1e3:.3f} ms   actor pid {d['pid']}")
    return 0


def _table(rows: list[tuple[Any, ...]]) -> None:
    widths = [max(len(str(r[c])) for r in rows) for c in range(len(rows[0]))]
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())


def run_cluster_plan(args: argparse.Namespace) -> int:
    """``vkpool plan MODEL --cluster ADDRESS|SPEC.yaml``: the plan a ClusterSession runs with
    these options (``--budget`` is a what-if), or over a spec file's members."""
    from vkpool.cluster.links import load_cluster_spec
    from vkpool.cluster.placement import place_on_cluster
    from vkpool.partition.cli import apply_budgets
    from vkpool.partition.render import render
    from vkpool.units import parse_size

    if args.devices or args.remote is not None:
        raise ValueError("--cluster plans over the cluster's members; drop --devices and --remote")
    model = Path(args.model).read_bytes()
    options = dict(objective=args.objective or "latency", algorithm=args.algorithm or "dp",
                   batch=args.batch or 1)
    if is_spec_file(args.cluster):
        members = apply_budgets(load_cluster_spec(args.cluster), args.budget)
        _, graph, plan = place_on_cluster(model, members, **options)
    else:
        from vkpool.cluster import connect
        from vkpool.partition.cli import parse_overrides

        with connect(args.cluster) as cluster:
            listed = cluster.members()
            used = {m["id"]: m["used_bytes"] for m in listed}
            overrides = parse_overrides(args.budget, list(used))
            what_if = {k: parse_size(v) - used[k] for k, v in overrides.items()}
            members = cluster.planner_members(what_if)
        _, graph, plan = place_on_cluster(model, members, **options)
    from vkpool.partition.cli import write_plan

    write_plan(render(graph, plan, args.format), args.output)
    return 0

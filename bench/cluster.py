"""``python -m bench.cluster``: vkpool on a Ray cluster of two nodes started on this host.

Starts a local Ray cluster (``ray.cluster_utils.Cluster``) of two vkpool nodes, ``a`` and ``b``,
and prints a table of:

- **replicas**: jobs/s of a model replicated over both nodes (``objective="throughput"``)
  against the same model on node ``a`` alone, with up to ``--window`` requests in flight;
- **split**: jobs/s of the model split into two pipeline stages, one per node (each node's
  budget below the model, so the planner must split it), against node ``a`` alone;
- **hop**: the cost of moving a tensor from node ``a`` to node ``b`` through Ray's object store
  (put on ``a``, pulled by ``b``), per MiB: the slope of a fit over 1–64 MiB.

Every output is compared with the single-node session's first. Without ``--gpus`` each node
offers a split of device 0 (``vk0.0``, ``vk0.1``; lavapipe on a machine without GPUs); with
``--gpus`` node ``i`` is given GPU ``i`` as Ray gives GPUs (``num_gpus=1``,
``CUDA_VISIBLE_DEVICES=i``), which its actor maps to the Vulkan device of that UUID.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench import workloads

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


def jobs_per_s(session: Any, feeds: dict[str, np.ndarray], want: list[np.ndarray], seconds: float,
               window: int) -> float:
    """Requests completed per second with ``window`` in flight, for about ``seconds``."""
    for out, ref in zip(session.run(None, feeds), want):
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    for _ in range(window):
        session.run(None, feeds)
    in_flight = [session.submit(feeds) for _ in range(window)]
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        in_flight.pop(0).result(timeout=300)
        done += 1
        in_flight.append(session.submit(feeds))
    elapsed = time.perf_counter() - start
    for future in in_flight:
        future.result(timeout=300)
    return done / elapsed


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


def split_budget(cluster: Any, path: Path, member: str) -> int:
    """A budget that holds the larger half of the model's most even two-way cut (5% over what
    the planner prices it at), and not the whole model."""
    from vkpool.partition.plan import chunk_peak_bytes
    from vkpool.placement import balanced_cut

    with cluster.session(path, devices=[member]) as probe:
        whole = probe.placement.memory_bytes[member]
        half = max(chunk_peak_bytes(probe.graph, ops) for ops in balanced_cut(probe.graph, 2))
    return min(int(half * 1.05), whole - 1)


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
    args = parser.parse_args(argv)
    split_model = args.split or ("conv_many_255MB" if args.gpus else "mnist12_like")

    import vkpool.cluster
    from vkpool.cluster.links import node_of

    folder = Path(tempfile.mkdtemp(prefix="vkpool-bench-cluster-"))
    os.environ.setdefault("VKPOOL_CACHE_DIR", str(folder / "cache"))
    ray_cluster = start_cluster(args.gpus, folder)
    rows: list[tuple[str, str, str, str]] = []
    try:
        with vkpool.cluster.connect(ray_cluster.address) as cluster:
            a, b = member_of(cluster, "a"), member_of(cluster, "b")
            budgets = {m["id"]: m["budget_bytes"] for m in cluster.members()}
            listed = ", ".join(f"{m['id']} ({m['name']})" for m in cluster.members())
            print(f"nodes: {listed}", file=sys.stderr)
            for kind, name in (("replicas", args.replicated), ("split", split_model)):
                path = workloads.save(name, folder)
                feeds = workloads.input_for(name)
                with cluster.session(path, devices=[a]) as one:
                    want = one.run(None, feeds)
                    single = jobs_per_s(one, feeds, want, args.seconds, args.window)
                if kind == "replicas":
                    options: dict[str, Any] = {"objective": "throughput", "devices": [a, b]}
                else:  # budgets under the model on each node: the planner must cut it in two
                    cap = split_budget(cluster, path, a)
                    options = {"objective": "throughput", "budgets": {a: cap, b: cap}}
                with cluster.session(path, **options) as two:
                    plan = two.placement
                    copies = ", ".join([plan.chunks[0].member, *plan.replicas])
                    shape = (f"replicas on {copies}" if plan.replicas
                             else " → ".join(c.member for c in plan.chunks))
                    if len({node_of(m) for c in plan.chunks for m in [c.member, *plan.replicas]}) < 2:
                        raise RuntimeError(f"the {kind} plan does not span both nodes: {shape}")
                    both = jobs_per_s(two, feeds, want, args.seconds, args.window)
                for member in (a, b):
                    cluster.set_budget(member, budgets[member])
                rows.append((f"{kind}: {name}", f"{single:.1f}", f"{both:.1f}",
                             f"{both / single:.2f}  ({shape})"))
            slope, fixed, points = hop_s_per_mib(cluster)
    finally:
        ray_cluster.shutdown()
    print("| figure | one node jobs/s | two nodes jobs/s | two / one |\n|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nhop a → b through the object store: {slope * 1e3:.2f} ms per MiB + {fixed * 1e3:.2f} ms "
          f"({', '.join(f'{m} MiB {s * 1e3:.1f} ms' for m, s in points)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

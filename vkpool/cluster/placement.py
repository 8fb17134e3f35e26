"""Where a model runs on a cluster: the one placement ``vkpool plan --cluster`` shows and a
:class:`~vkpool.cluster.session.ClusterSession` runs.

:func:`place_on_cluster` loads the model as every node will (static shapes, the same node names)
and hands it to :func:`vkpool.partition.place_model` over the cluster's planner members
(:mod:`vkpool.cluster.links`): the whole model on the first Vulkan member that holds it (latency),
else the DP's plan over the Vulkan members of every node (pipeline stages across nodes), else
over every member; with ``objective="throughput"`` whole copies on every member that holds one
(replicas per node) where they beat a pipeline. Nothing fits: the planners' ``PartitionUnfeasible``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from vkpool.placement import PlanView


def place_on_cluster(model: bytes | str, members: Sequence[Any], *, objective: str = "latency",
                     devices: Sequence[str] | None = None, plan: Any = None, batch: int = 1,
                     dims: Mapping[str, int] | None = None, algorithm: str = "dp") -> tuple[Any, Any, Any]:
    """(loaded model, op graph, Plan) of ``model`` on ``members`` (cluster planner members, in
    order); ``devices``: plan over exactly these member ids; ``plan``: a Plan made for this
    model on these members, checked and kept."""
    from vkpool.column_split import blocks_named, split_products
    from vkpool.cut import Graph, find_cut
    from vkpool.model import load_model
    from vkpool.partition.api import place_model
    from vkpool.partition.graph import build_graph
    from vkpool.partition.plan import PartitionUnfeasible, Plan, plan_problems

    loaded = load_model(model, batch=batch, dims=dict(dims or {}), partial=True)
    split = find_cut(Graph.of(loaded))
    if split is not None:
        where = "; ".join(dict.fromkeys(p.describe() for p in split.points))
        raise ValueError(f"the model's shapes depend on run-time values ({where}): a cluster runs models "
                         "whose shapes are fixed at load; run this one with vkpool.Session on one node")
    if loaded.unresolved:
        load_model(model, batch=batch, dims=dict(dims or {}))  # the loader's own error names the tensor
    if plan is not None and devices is not None:
        raise ValueError("give one of devices (a plan over them) or plan")
    if devices is not None:
        by_id = {m.id: m for m in members}
        unknown = [d for d in devices if d not in by_id]
        if unknown:
            raise KeyError(f"no cluster member {unknown[0]!r}; members: {', '.join(by_id)}")
        members = [by_id[d] for d in devices]
    if plan is not None:
        plan = getattr(plan, "partition_plan", plan)  # a ClusterPlan: the Plan it shows
        if not isinstance(plan, Plan):
            raise TypeError("plan must be a vkpool.partition.Plan made for this model on the cluster's "
                            "members")
        known = {m.id for m in members}
        strangers = sorted(({c.member for c in plan.chunks} | set(plan.replicas)) - known)
        if strangers:
            raise KeyError(f"the plan names members the cluster lacks: {', '.join(strangers)}; members: "
                           f"{', '.join(sorted(known))}")
        split_products(loaded, blocks_named(loaded, plan.member_of))
        graph = build_graph(loaded)
        chosen = plan
    else:
        graph, chosen = place_model(loaded, members, objective=objective, algorithm=algorithm,
                                    plan_over_all=devices is not None)
    problems = plan_problems(graph, chosen)
    if problems:
        raise PartitionUnfeasible("; ".join(problems), shortfall_bytes={})
    return loaded, graph, chosen


class ClusterPlan(PlanView):
    """A cluster's Plan as a session runs it: reads like the Plan (``member_of``, ``chunks``,
    ``transfers``, ``replicas``, ...) and renders as ``vkpool plan`` does."""



"""The one call most users need: a loaded model and members in, a Plan out."""
from __future__ import annotations

from typing import Sequence

import networkx as nx

from vkpool.partition.algorithms import OBJECTIVES, dp_partition, greedy_partition
from vkpool.partition.cost import Member
from vkpool.partition.graph import build_graph
from vkpool.partition.plan import Plan

ALGORITHMS = {"dp": dp_partition, "greedy": greedy_partition}


def plan_model(
    model: object,
    members: Sequence[Member],
    *,
    objective: str = "latency",
    algorithm: str = "dp",
) -> Plan:
    """Plans ``model`` (a :class:`~vkpool.model.LoadedModel` or a graph from
    :func:`~vkpool.partition.graph.build_graph`) on ``members`` (in priority order).

    Raises :class:`~vkpool.partition.plan.PartitionUnfeasible` when nothing fits; never returns None.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")
    if not members:
        raise ValueError("no members to plan on")
    G = model if isinstance(model, nx.DiGraph) else build_graph(model)  # type: ignore[arg-type]
    return ALGORITHMS[algorithm](G, members, objective=objective)

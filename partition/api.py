"""The calls most users need: a loaded model and members in, a Plan out.

:func:`plan_model` runs one planner; :func:`place_model` is where vkpool runs a model, the one
placement that ``vkpool plan``, ``vkpool run``, :class:`vkpool.Session` and the daemon share.
"""
from __future__ import annotations

from typing import Any, Sequence

import networkx as nx

from vkpool.config.loader import PLACEMENTS
from vkpool.partition.algorithms import OBJECTIVES, dp_partition, greedy_partition
from vkpool.partition.cost import Member
from vkpool.partition.graph import build_graph
from vkpool.partition.plan import PartitionUnfeasible, Plan, build_plan

ALGORITHMS = {"dp": dp_partition, "greedy": greedy_partition}
#: how :func:`place_model` picks the member that runs a whole model (config ``placement``)
POLICIES = PLACEMENTS
#: ``Plan.algorithm`` of a placement that puts the whole model on one member without planning
WHOLE = "whole"


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
    _check(objective, algorithm)
    if not members:
        raise ValueError("no members to plan on")
    G = model if isinstance(model, nx.DiGraph) else build_graph(model)  # type: ignore[arg-type]
    return ALGORITHMS[algorithm](G, members, objective=objective)


def place_model(
    model: Any,
    members: Sequence[Member],
    *,
    objective: str = "latency",
    algorithm: str = "dp",
    plan_over_all: bool = False,
    policy: str = "fastest",
) -> tuple[nx.DiGraph, Plan]:
    """Where vkpool runs ``model`` (a :class:`~vkpool.model.LoadedModel`) on ``members`` (planner
    members in the pool's order, each budget being what the member has free): the model's graph
    and the plan.

    With ``plan_over_all`` (``Session(devices=...)``, ``vkpool plan --devices``) it is the
    planner's plan over exactly these members. Otherwise the first that fits of:

    1. with the latency objective, the whole model on one member whose budget holds it (its peak
       memory as :mod:`vkpool.partition.plan` prices it); ``algorithm`` is :data:`WHOLE`. Which
       one is ``policy``'s choice (:data:`POLICIES`): ``fastest``, the one whose predicted latency
       is least (the earlier member on a tie) when every member's speeds are measured (``vkpool
       calibrate``) or set in the config (``Member.measured``), else as ``vulkan``; ``vulkan``, the first
       Vulkan member (the host member only when there is none);
    2. the planner's plan over the Vulkan members;
    3. the planner's plan over every member (the host member joins only here).

    With no Vulkan member, 1 and 3 apply to the host members. Products whose weight passes half
    the largest budget of the members first planned over are divided into column blocks first
    (:func:`vkpool.column_split.split_for_budgets`), in place, as the compile then needs them.
    Raises :class:`PartitionUnfeasible` naming what each step lacked. O(ops + reads) per
    member for step 1, then the planner's cost.
    """
    from vkpool.column_split import split_for_budgets

    _check(objective, algorithm, policy)
    if not members:
        raise ValueError("no members to place on: check the config's device rules and host.enabled")
    if plan_over_all:
        split_for_budgets(model, [m.budget_bytes for m in members])
        G = build_graph(model)
        return G, plan_model(G, members, objective=objective, algorithm=algorithm)
    first = [m for m in members if m.kind == "vulkan"] or list(members)
    G = build_graph(model)
    reasons: list[str] = []
    if objective == "latency":
        fitting: list[Plan] = []
        by_speed = policy == "fastest" and all(m.measured for m in members)
        for m in members if by_speed else first:
            whole = build_plan(G, {op: m.id for op in G.graph["order"]}, [m], objective=objective, algorithm=WHOLE)
            if whole.memory_bytes[m.id] > m.budget_bytes:
                reasons.append(f"{m.id} alone needs {whole.memory_bytes[m.id]} bytes of {m.budget_bytes} free")
            elif not by_speed:
                return G, whole
            else:
                fitting.append(whole)
        if fitting:
            return G, min(fitting, key=lambda p: p.latency_s)  # min keeps the first of equals
    if split_for_budgets(model, [m.budget_bytes for m in first]):
        G = build_graph(model)
    shortfall: dict[str, int] = {}
    for group in ([first, list(members)] if len(first) < len(members) else [first]):
        try:
            return G, plan_model(G, group, objective=objective, algorithm=algorithm)
        except PartitionUnfeasible as exc:
            reasons.append(f"a plan over {', '.join(m.id for m in group)}: {exc}")
            shortfall = exc.shortfall_bytes
    raise PartitionUnfeasible("no member's budget holds the whole model, nor do the members together: "
                              + "; ".join(reasons), shortfall_bytes=shortfall)


def _check(objective: str, algorithm: str, policy: str = "fastest") -> None:
    if policy not in POLICIES:
        raise ValueError(f"placement policy must be one of {POLICIES}, got {policy!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {sorted(ALGORITHMS)}, got {algorithm!r}")

"""An exact integer-programming oracle for the contiguous-segment plans, for small graphs.

Formulation (segments as arcs, after Bokhari's layered graph for chain partitioning: S. H. Bokhari,
*Partitioning problems in parallel, pipelined, and distributed computing*, IEEE Trans. Computers
37(1), 1988; the path as a unit flow, Ahuja, Magnanti & Orlin, *Network Flows*, 1993, §4):
nodes are the cut positions ``0 .. n`` of the topological order; an arc ``(i, e, k)`` is the
segment ``[i, e)`` run on member ``k``, present only when the segment's peak memory fits the
member's budget. A binary ``x[i,e,k]`` per arc;

- one unit of flow leaves position 0 and reaches position n; flow is conserved in between;
- each member carries at most one arc (``Σ_{i,e} x[i,e,k] ≤ 1``), the side constraint that
  makes this a resource-constrained shortest path rather than a plain one;
- latency: minimise ``Σ c[i,e,k]·x``; throughput: minimise ``T`` with
  ``T ≥ Σ_{i,e} s[i,e,k]·x[i,e,k]`` per member (one arc per member, so that sum is its stage).

The optimum is lexicographic like the other algorithms': a second solve fixes the objective at
its optimum and minimises the bytes moved between members. Arc costs come from
:func:`~vkpool.partition.algorithms.segment_cost` and
:func:`~vkpool.partition.plan.chunk_peak_bytes` (direct loops), and the search is HiGHS's branch
and bound (``scipy.optimize.milp``), so nothing is shared with the DP's column arithmetic.
O(n²·m) variables, O(n + m) constraints; exponential in the worst case: for tests.

scipy is an optional dependency (the ``test`` extra): it is imported when this function runs.
"""
from __future__ import annotations

import time
from typing import Sequence

import networkx as nx
import numpy as np

from vkpool.partition.algorithms import OBJECTIVES, segment_cost
from vkpool.partition.cost import Member
from vkpool.partition.plan import PartitionUnfeasible, Plan, build_plan, chunk_peak_bytes
from vkpool.partition.graph import positions


def ilp_partition(G: nx.DiGraph, members: Sequence[Member], *, objective: str = "latency") -> Plan:
    """The optimal contiguous-segment plan by integer programming (see the module docstring).

    Raises :class:`PartitionUnfeasible` when no segment plan fits and ``RuntimeError`` when the
    solver stops without proving optimality.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    from scipy.optimize import Bounds, LinearConstraint, milp

    t0 = time.perf_counter()
    order = G.graph["order"]
    n, m = len(order), len(members)
    pos = positions(G)
    arcs: list[tuple[int, int, int]] = []
    priced: list[tuple[int, int, int]] = []  # (latency ps, stage ps, cross bytes)
    for i in range(n):
        for e in range(i + 1, n + 1):
            ops = order[i:e]
            peak = chunk_peak_bytes(G, ops, pos)
            for k, member in enumerate(members):
                if peak <= member.budget_bytes:
                    arcs.append((i, e, k))
                    priced.append(segment_cost(G, ops, member))
    if not arcs:
        raise PartitionUnfeasible("ilp: no segment fits any member", shortfall_bytes={})
    count = len(arcs)
    latency = np.array([p[0] for p in priced], np.float64)
    stage = np.array([p[1] for p in priced], np.float64)
    cross = np.array([p[2] for p in priced], np.float64)

    # flow: row p is (arcs leaving p) − (arcs entering p) = 1 at 0, 0 inside; position n follows
    flow = np.zeros((n, count))
    uses = np.zeros((m, count))
    for a, (i, e, k) in enumerate(arcs):
        flow[i, a] += 1
        if e < n:
            flow[e, a] -= 1
        uses[k, a] = 1
    supply = np.zeros(n)
    supply[0] = 1
    base = [LinearConstraint(flow, supply, supply), LinearConstraint(uses, 0, 1)]

    def solve(cost: np.ndarray, extra: list[LinearConstraint], with_period: bool):
        # variables: the arcs, then (throughput) the period T
        width = count + (1 if with_period else 0)
        c = np.zeros(width)
        c[:len(cost)] = cost
        if with_period:
            c[-1] = 1
        constraints = list(base)
        if with_period:
            constraints = [LinearConstraint(np.hstack([g.A, np.zeros((g.A.shape[0], 1))]), g.lb, g.ub)
                           for g in constraints]
            # T − Σ s·x ≥ 0 per member, in units of the largest stage: HiGHS misjudged some
            # feasible models as infeasible with picosecond coefficients of 1e9 next to the 1s
            rows = np.hstack([-uses * (stage / stage.max()), np.ones((m, 1))])
            constraints.append(LinearConstraint(rows, 0, np.inf))
        constraints += extra
        integrality = np.ones(width)
        upper = np.ones(width)
        if with_period:
            integrality[-1], upper[-1] = 0, np.inf
        return milp(c, constraints=constraints, integrality=integrality, bounds=Bounds(0, upper),
                    options={"mip_rel_gap": 0.0})

    if objective == "latency":
        first = solve(latency, [], False)
        _check(first)
        if first.status == 2:
            raise PartitionUnfeasible("ilp: no contiguous-segment plan fits the budgets", shortfall_bytes={})
        best = round(float(latency @ np.round(first.x)))
        # every value is an integer: "≤ best + ½" keeps exactly the plans that tie with the optimum
        tie = [LinearConstraint(latency[None, :], -np.inf, best + 0.5)]
    else:
        first = solve(np.array([]), [], True)
        _check(first)
        if first.status == 2:
            raise PartitionUnfeasible("ilp: no contiguous-segment plan fits the budgets", shortfall_bytes={})
        chosen = np.round(first.x[:count])
        best = round(float((uses * stage @ chosen).max()))
        tie = [LinearConstraint(uses * stage, -np.inf, best + 0.5)]
    second = solve(cross, tie, False)
    _check(second)
    chosen = np.flatnonzero(np.round(second.x) > 0.5)
    member_of = {order[t]: members[arcs[a][2]].id for a in chosen for t in range(arcs[a][0], arcs[a][1])}
    plan = build_plan(G, member_of, members, objective=objective, algorithm="ilp")
    plan.solve_time_s = time.perf_counter() - t0
    return plan


def _check(result) -> None:
    # 0 optimal, 2 infeasible (the caller's answer); anything else is a solver limit, not a plan
    if result.status not in (0, 2):
        raise RuntimeError(f"ilp: the solver stopped without an optimum: {result.message}")

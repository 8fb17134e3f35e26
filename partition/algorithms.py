"""Partition algorithms: plain functions from an op graph and members to a :class:`Plan`.

The search space of :func:`dp_partition` and :func:`exhaustive_partition` is the same: cut the
graph's topological order into contiguous segments and give each segment its own member (a
member hosts at most one segment; any member order). The optimum is lexicographic: first the
objective (``latency`` = chain of chunks and transfers, ``throughput`` = slowest member, its
copy engine included), then the fewest bytes moved between members.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

import networkx as nx
import numpy as np

from vkpool.partition.cost import Member, busy_ps, link_ps
from vkpool.partition.plan import PartitionUnfeasible, Plan, build_plan, chunk_peak_bytes
from vkpool.partition.segments import Column, columns, cost_groups

OBJECTIVES = ("latency", "throughput")
_INF = np.iinfo(np.int64).max // 4


def greedy_partition(G: nx.DiGraph, members: Sequence[Member], *, objective: str = "latency") -> Plan:
    """VKML's first-fit allocator (Baker et al., *VKML*, §4): in topological order, each op goes to
    the first member, in the given priority order, with enough budget left for what the op adds:
    the weights and input tensors not yet on that member, its outputs and its workspace. Nothing
    is ever freed (every tensor is charged for the whole run). The engine's staging copies are
    charged too: an input an op re-reads is held twice, and so is a large output, which may be
    sent to another member later (charged whether it is or not). O(ops · members + reads).
    """
    t0 = time.perf_counter()
    uses = G.graph["tensors"]
    left = {m.id: m.budget_bytes for m in members}
    resident: dict[str, set[str]] = {m.id: set() for m in members}
    copied: dict[str, set[str]] = {m.id: set() for m in members}
    staged = G.graph.get("staged_output_bytes")
    member_of: dict[str, str] = {}
    for op in G.graph["order"]:
        attrs = G.nodes[op]
        big_outputs = [t for t in attrs["outputs"] if staged is not None and uses[t].nbytes >= staged]
        needs = {}
        for m in members:
            have = resident[m.id]
            extra = sum(b for t, b in attrs["weights"].items() if t not in have)
            extra += sum(uses[t].nbytes for t in attrs["inputs"] if t not in have)
            if attrs.get("rereads_inputs"):
                extra += sum(uses[t].nbytes for t in attrs["inputs"] if t not in copied[m.id])
            extra += sum(uses[t].nbytes for t in attrs["outputs"]) + attrs["workspace_bytes"]
            extra += sum(uses[t].nbytes for t in big_outputs)
            needs[m.id] = extra
        chosen = next((m.id for m in members if needs[m.id] <= left[m.id]), None)
        if chosen is None:
            short = {m.id: needs[m.id] - left[m.id] for m in members}
            raise PartitionUnfeasible(
                f"greedy: op {op} fits on no member; more budget needed: {_fmt_short(short)}",
                shortfall_bytes=short, unplaceable_op=op)
        left[chosen] -= needs[chosen]
        resident[chosen].update(attrs["weights"], attrs["inputs"], attrs["outputs"])
        copied[chosen].update(big_outputs)
        if attrs.get("rereads_inputs"):
            copied[chosen].update(attrs["inputs"])
        member_of[op] = chosen
    return build_plan(G, member_of, members, objective=objective, algorithm="greedy",
                      solve_time_s=time.perf_counter() - t0)


def dp_partition(
    G: nx.DiGraph, members: Sequence[Member], *, objective: str = "latency", replicate: bool = True
) -> Plan:
    """Optimal contiguous-segment plan by dynamic programming over (prefix, set of members used).

    ``f[S][e]`` is the best cost of running ops ``[0, e)`` on exactly the members in ``S``, one
    segment each; ``f[S][e] = min over d ∈ S, i < e of f[S − d][i] ⊕ c_d(i, e)`` over
    memory-feasible segments, with ⊕ = ``+`` for latency and ``max`` for throughput. Latency is
    minimised lexicographically with transfer bytes (both additive, so exact); throughput first
    finds the optimal period by a bottleneck DP, then a second pass minimises bytes among plans
    within it. Segment costs stream a column at a time from :mod:`vkpool.partition.segments`.
    O(n² · 2^m · m) elementary steps, vectorised over the segment start and the member sets
    (n ops, m members); O(n · 2^m) memory.

    With ``objective="throughput"`` and ``replicate``, whole-model copies on every member that
    can hold the model alone are compared with the best pipeline, and the faster kept.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if not G.graph["order"]:
        raise ValueError("the graph has no ops")
    t0 = time.perf_counter()
    if objective == "latency":
        choice, last = _solve(G, members, "sum", None)
    else:
        period, last = _solve(G, members, "period", None)
        choice, last = _solve(G, members, "bytes", period) if period is not None else (None, last)
    if choice is None:
        raise _unfeasible(G, members)
    plan = build_plan(G, _assignment(G, members, choice), members, objective=objective, algorithm="dp")
    if objective == "throughput" and replicate:
        whole = int(last.peak[0])
        alone = [k for k, mm in enumerate(members) if whole <= mm.budget_bytes]
        if len(alone) > 1:
            stage = _MemberRows(members)(last)[2]
            best = min(alone, key=lambda k: int(stage[k][0]))
            rest = [members[k].id for k in alone if k != best]
            replicated = build_plan(G, {op: members[best].id for op in G.graph["order"]}, members,
                                    objective=objective, algorithm="dp", replicas=rest)
            # ties (within float noise) go to the copies: they move no tensor between members
            gain = replicated.throughput_per_s - plan.throughput_per_s
            if gain > 1e-9 * plan.throughput_per_s or (abs(gain) <= 1e-9 * plan.throughput_per_s
                                                        and replicated.transfer_bytes < plan.transfer_bytes):
                plan = replicated
    plan.solve_time_s = time.perf_counter() - t0
    return plan


class _MemberRows:
    """Prices a column for every member at once: feasible, latency cost and stage period, each an
    (m, e − lo) array over the starts from ``lo``. Members of equal cost share one row of work."""

    def __init__(self, members: Sequence[Member]) -> None:
        self.budgets = np.array([mm.budget_bytes for mm in members], np.int64)[:, None]
        distinct, self.group = cost_groups(members)
        self.latency_s = np.array([c.transfer_latency_s + c.network_latency_s for c in distinct])[:, None]
        self.busy_s = np.array([c.transfer_latency_s for c in distinct])[:, None]
        self.h2d = np.array([c.h2d_bytes_per_s for c in distinct])[:, None]
        self.d2h = np.array([c.d2h_bytes_per_s for c in distinct])[:, None]
        self.most = int(self.budgets.max())

    def first_start(self, col: Column) -> int:
        """The first start whose segment fits some member (``col.end`` when none does)."""
        fits = col.peak <= self.most
        return int(fits.argmax()) if fits.any() else col.end

    def __call__(self, col: Column, lo: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # the same expressions as MemberCost.upload_ps/download_ps/link_busy_ps, broadcast over members
        up, down = col.up_bytes[None, lo:], col.down_bytes[None, lo:]
        link = link_ps(up, self.latency_s, self.h2d) + link_ps(down, self.latency_s, self.d2h)
        busy = busy_ps(up, down, self.busy_s, self.h2d, self.d2h)
        compute = np.stack([c[lo:] for c in col.compute_ps])
        latency, stage = compute + link, np.maximum(compute, busy)
        if len(self.latency_s) > 1 or len(self.group) == 1:
            latency, stage = latency[self.group], stage[self.group]
        else:  # one cost for all: broadcast the row instead of copying it
            latency = np.broadcast_to(latency, (len(self.group), latency.shape[1]))
            stage = np.broadcast_to(stage, latency.shape)
        return col.peak[None, lo:] <= self.budgets, latency, stage


def member_classes(members: Sequence[Member]) -> list[list[int]]:
    """Indices of ``members`` grouped by (budget, cost), in order: members of a class are
    interchangeable, so the DP counts how many of a class it has used instead of which."""
    groups: dict[tuple[int, Any], list[int]] = {}
    for index, mm in enumerate(members):
        groups.setdefault((mm.budget_bytes, mm.cost), []).append(index)
    return list(groups.values())


def _solve(G: nx.DiGraph, members: Sequence[Member], mode: str, period: int | None):
    """One DP pass over the columns. Modes (primary key, secondary key):

    - ``"sum"``: (latency, cross bytes), both additive;
    - ``"period"``: the bottleneck: max stage period (returns that value, not segments);
    - ``"bytes"``: (cross bytes, latency) over segments whose stage fits in ``period``.

    A state is how many members of each class (:func:`member_classes`) the prefix uses, a
    mixed-radix number: with m distinct members that is the set of used members (2^m states);
    with m identical ones, a count (m + 1 states). Every (state S, class k used in S) pair is one
    row of a (classes, H, width) array: row (k, h) reads the predecessor S − one of k from the
    table and adds class k's segment costs, broadcast over the states, so a column costs a fixed
    number of numpy calls. Starts before the first one any member can take (memory, and in
    ``"bytes"`` mode the period) are cut off the width.
    Returns (segments [(start, end, member index)] or the period, or None; the last column).
    """
    n = len(G.graph["order"])
    classes = member_classes(members)
    counts = np.array([len(c) for c in classes], np.int64)
    strides = np.concatenate([[1], np.cumprod(counts + 1)[:-1]]).astype(np.int64)
    n_states = int(np.prod(counts + 1))
    dummy = n_states  # an always-unreachable row that pads the pairs of classes used in fewer states
    digits = (np.arange(n_states)[:, None] // strides[None, :]) % (counts + 1)[None, :]
    with_k = [np.flatnonzero(digits[:, k] >= 1) for k in range(len(classes))]
    width = max(len(w) for w in with_k)
    states_kh = np.full((len(classes), width), dummy, np.int64)
    prev_kh = np.full((len(classes), width), dummy, np.int64)
    for k, w in enumerate(with_k):
        states_kh[k, :len(w)] = w
        prev_kh[k, :len(w)] = w - strides[k]
    mc = len(classes)
    k_of = np.repeat(np.arange(mc), width)
    flat_states = states_kh.ravel()
    primary = np.full((n_states + 1, n + 1), _INF, np.int64)
    primary[0, 0] = 0
    two_keys = mode != "period"
    if two_keys:
        secondary = np.full((n_states + 1, n + 1), _INF, np.int64)
        secondary[0, 0] = 0
        back_start = np.full((n_states + 1, n + 1), -1, np.int64)
        back_class = np.full((n_states + 1, n + 1), -1, np.int64)
    rows = _MemberRows([members[c[0]] for c in classes])
    col = None
    for col in columns(G, members):
        e = col.end
        lo = rows.first_start(col)
        if lo == e:
            continue
        feasible, latency, stage = rows(col, lo)
        if mode == "bytes":
            feasible &= stage <= period
        usable = feasible.any(axis=0)
        if not usable.any():
            continue
        cut = int(usable.argmax())
        if cut:
            feasible, latency, stage = feasible[:, cut:], latency[:, cut:], stage[:, cut:]
            lo += cut
        if mode == "period":
            a = np.maximum(primary[prev_kh, lo:e], np.where(feasible, stage, _INF)[:, None, :])
            np.minimum.at(primary[:, e], flat_states, a.min(axis=2).ravel())
            primary[dummy, e] = _INF
            continue
        if mode == "sum":
            cost_a, cost_b = np.where(feasible, latency, _INF), col.cross_bytes[None, lo:]
        else:  # primary holds bytes, secondary latency
            cost_a, cost_b = np.where(feasible, col.cross_bytes[None, lo:], _INF), latency
        a = primary[prev_kh, lo:e] + cost_a[:, None, :]
        pick = a.argmin(axis=2)
        ka = np.take_along_axis(a, pick[..., None], axis=2)[..., 0]
        # the secondary key only matters where the primary ties: price it for those rows alone
        tied = np.count_nonzero(a == ka[..., None], axis=2) > 1
        cost_b = np.broadcast_to(cost_b, (mc, e - lo))
        for k, h in zip(*np.nonzero(tied & (ka < _INF))):
            b = np.where(a[k, h] == ka[k, h], secondary[prev_kh[k, h], lo:e] + cost_b[k], _INF)
            pick[k, h] = b.argmin()
        kb = secondary[prev_kh, pick + lo] + np.take_along_axis(cost_b, pick, axis=1)
        ka, kb, pick = ka.ravel(), kb.ravel(), pick.ravel()
        ranked = np.lexsort((kb, ka))  # best first, then the first pair of each state wins
        ranked = ranked[(ka[ranked] < _INF) & (flat_states[ranked] != dummy)]
        ranked = ranked[np.unique(flat_states[ranked], return_index=True)[1]]
        target = flat_states[ranked]
        primary[target, e], secondary[target, e] = ka[ranked], kb[ranked]
        back_start[target, e] = pick[ranked] + lo
        back_class[target, e] = k_of[ranked]
    final = [(int(primary[S, n]), int(secondary[S, n]) if two_keys else 0, S)
             for S in range(1, n_states) if primary[S, n] < _INF]
    if not final:
        return None, col
    key_p, _, S = min(final)
    if mode == "period":
        return key_p, col
    segments = []
    e = n
    while e > 0:
        i, k = int(back_start[S, e]), int(back_class[S, e])
        segments.append((i, e, k))
        S -= int(strides[k])
        e = i
    # the members of a class are interchangeable: give them out in their priority order
    unused = [list(c) for c in classes]
    return [(i, e, unused[k].pop(0)) for i, e, k in reversed(segments)], col


def _assignment(G: nx.DiGraph, members: Sequence[Member], segments) -> dict[str, str]:
    order = G.graph["order"]
    return {order[t]: members[k].id for i, e, k in segments for t in range(i, e)}


def _unfeasible(G: nx.DiGraph, members: Sequence[Member]) -> PartitionUnfeasible:
    """Says which op fits nowhere, or how much more budget each member needs to take it all."""
    order = G.graph["order"]
    col = None
    for col in columns(G, members):
        e = col.end
        alone = int(col.peak[e - 1])  # the op e-1 as a segment by itself
        if all(alone > mm.budget_bytes for mm in members):
            short = {mm.id: alone - mm.budget_bytes for mm in members}
            return PartitionUnfeasible(
                f"op {order[e - 1]} needs {alone} bytes by itself and fits on no member; "
                f"more budget needed: {_fmt_short(short)}", shortfall_bytes=short, unplaceable_op=order[e - 1])
    if col is None:
        raise ValueError("the graph has no ops")
    whole = int(col.peak[0])
    short = {mm.id: max(0, whole - mm.budget_bytes) for mm in members}
    return PartitionUnfeasible(
        f"no split of the model fits the budgets; the whole model needs {whole} bytes, so any one of "
        f"these increases makes it fit: {_fmt_short(short)}", shortfall_bytes=short)


def _fmt_short(short: dict[str, int]) -> str:
    from vkpool.units import format_size

    return ", ".join(f"{k} +{format_size(v)}" for k, v in short.items())


def exhaustive_partition(G: nx.DiGraph, members: Sequence[Member], *, objective: str = "latency") -> Plan:
    """The oracle: every cut of the order into k ≤ m contiguous segments and every injective
    assignment of members to them. Each (segment, member) is priced once by
    :func:`segment_cost`, a direct loop over the segment's ops, independent of the DP's column
    arithmetic; the best is then built with :func:`build_plan`.
    O(n²·m) pricing + O(Σ_k C(n−1, k−1) · m!/(m−k)!) enumeration: for tests on small graphs.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    t0 = time.perf_counter()
    order = G.graph["order"]
    n = len(order)
    priced: dict[tuple[int, int, int], tuple[int, int, int] | None] = {}

    def price(i: int, e: int, k: int) -> tuple[int, int, int] | None:
        if (i, e, k) not in priced:
            ops = order[i:e]
            fits = chunk_peak_bytes(G, ops) <= members[k].budget_bytes
            priced[i, e, k] = segment_cost(G, ops, members[k]) if fits else None
        return priced[i, e, k]

    best_key, best = None, None
    for k in range(1, min(n, len(members)) + 1):
        for cuts in itertools.combinations(range(1, n), k - 1):
            bounds = (0, *cuts, n)
            for chosen in itertools.permutations(range(len(members)), k):
                priced_or_none = [price(bounds[s], bounds[s + 1], chosen[s]) for s in range(k)]
                costs = [c for c in priced_or_none if c is not None]
                if len(costs) < k:
                    continue
                if objective == "latency":
                    value = sum(c[0] for c in costs)
                else:
                    value = max(c[1] for c in costs)
                key = (value, sum(c[2] for c in costs))
                if best_key is None or key < best_key:
                    best_key, best = key, (bounds, chosen)
    if best is None:
        raise PartitionUnfeasible("no contiguous-segment plan fits the budgets", shortfall_bytes={})
    bounds, chosen = best
    member_of = {order[t]: members[chosen[s]].id for s in range(len(chosen))
                 for t in range(bounds[s], bounds[s + 1])}
    plan = build_plan(G, member_of, members, objective=objective, algorithm="exhaustive")
    plan.solve_time_s = time.perf_counter() - t0
    return plan


def segment_cost(G: nx.DiGraph, ops: Sequence[str], member: Member) -> tuple[int, int, int]:
    """(latency ps, stage period ps, bytes received from other segments) of ``ops`` run as one
    chunk on ``member`` in a plan where every other op is on another member; O(reads)."""
    uses = G.graph["tensors"]
    inside = set(ops)
    compute = 0
    up: dict[str, int] = {}
    cross = 0
    down: dict[str, int] = {}
    for op in ops:
        attrs = G.nodes[op]
        compute += member.cost.op_ps(attrs["flops"], attrs["bytes_read"] + attrs["bytes_written"])
        for t in attrs["inputs"]:
            if uses[t].producer not in inside:
                up[t] = uses[t].nbytes
        for t in attrs["outputs"]:
            if uses[t].is_output or any(c not in inside for c in uses[t].consumers):
                down[t] = uses[t].nbytes
    cross = sum(b for t, b in up.items() if uses[t].producer is not None)
    up_bytes, down_bytes = sum(up.values()), sum(down.values())
    link = member.cost.upload_ps(up_bytes) + member.cost.download_ps(down_bytes)
    return compute + link, max(compute, member.cost.link_busy_ps(up_bytes, down_bytes)), cross


def plan_key(plan: Plan) -> tuple[float, int]:
    """What the optimum minimises: (objective value, transfer bytes); exact integers where possible."""
    if plan.objective == "latency":
        return (round(plan.latency_s * 1e12), plan.transfer_bytes)
    return (round(1e12 / plan.throughput_per_s), plan.transfer_bytes)

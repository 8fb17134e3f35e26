"""The Plan: which member runs each op, the chunks, the transfers, memory and predicted speed.

Pricing (one model for every algorithm, so plans compare):

- a **chunk** is a maximal run of consecutive ops (in the graph's topological order) on one
  member; it is one command buffer. Its time is ``upload + compute + download`` where upload
  moves, in one submission, every tensor it reads from another member or from the caller (graph
  inputs), and download moves every tensor it writes that another member or the caller (graph
  outputs) reads, once whatever the number of readers;
- **latency** is the chain: the sum of chunk times;
- **throughput** (inferences/s, pipelined): each member has a compute engine and a copy engine
  that overlap, so the period is the largest, over members, of their summed compute time and of
  the time their link is busy (bytes over bandwidth: with requests in flight, the latency of one
  request's transfer passes while the link carries another's); replicas (whole model on each of
  several members) add up;
- a chunk's **peak memory** is its weights (each constant once), plus the tensors it receives
  (held for the whole chunk), plus the peak of its live activations in execution order (a
  tensor lives from its producer to its last reader anywhere; graph outputs and tensors read by
  later chunks until the chunk ends), plus the largest workspace of its ops. A member's memory
  is its chunk's peak; a member running several chunks (greedy plans) counts the lower of two
  upper bounds: the sum of its chunks' peaks, and everything it ever holds, never freed.
  Budgets are hard limits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import networkx as nx

from vkpool.partition.cost import PS_PER_S, Member
from vkpool.partition.graph import positions


class PartitionUnfeasible(Exception):
    """No plan fits the budgets.

    ``shortfall_bytes``: per member, how many more bytes of budget would let the whole model run
    on it alone. ``unplaceable_op``: an op that fits on no member by itself (then ``shortfall``
    says, per member, what that op alone lacks).
    """

    def __init__(self, message: str, *, shortfall_bytes: dict[str, int], unplaceable_op: str | None = None):
        super().__init__(message)
        self.shortfall_bytes = shortfall_bytes
        self.unplaceable_op = unplaceable_op


@dataclass
class Chunk:
    index: int
    member: str
    ops: list[str]
    preds: list[int] = field(default_factory=list)
    succs: list[int] = field(default_factory=list)
    compute_ps: int = 0
    upload_ps: int = 0
    download_ps: int = 0
    upload_bytes: int = 0
    download_bytes: int = 0
    peak_bytes: int = 0

    @property
    def time_ps(self) -> int:
        return self.upload_ps + self.compute_ps + self.download_ps


@dataclass(frozen=True)
class Transfer:
    """One tensor staged device → host → device, once per tensor and destination member."""

    tensor: str
    nbytes: int
    src: str
    dst: str
    src_chunk: int
    dst_chunk: int


@dataclass
class Plan:
    member_of: dict[str, str]
    chunks: list[Chunk]
    transfers: list[Transfer]
    memory_bytes: dict[str, int]
    budget_bytes: dict[str, int]
    latency_s: float
    throughput_per_s: float
    objective: str
    algorithm: str
    solve_time_s: float = 0.0
    replicas: list[str] = field(default_factory=list)  # members running a whole copy besides the plan's

    @property
    def transfer_bytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    def chunk_dag(self) -> nx.DiGraph:
        D = nx.DiGraph()
        D.add_nodes_from(c.index for c in self.chunks)
        D.add_edges_from((p, c.index) for c in self.chunks for p in c.preds)
        return D


def chunk_peak_bytes(G: nx.DiGraph, ops: Sequence[str], pos: dict[str, int] | None = None) -> int:
    """Peak memory of a chunk running ``ops`` (consecutive in the order) on one member; O(reads).

    Besides weights, received tensors, live activations and workspace it counts the engine's
    staging copies: a received tensor that an op re-reading its inputs reads (node attribute
    ``rereads_inputs``) is held twice, in mapped memory and copied into device memory, and so is
    a sent tensor of at least ``G.graph["staged_output_bytes"]`` (computed in device memory and
    copied out)."""
    pos = pos or positions(G)
    uses = G.graph["tensors"]
    inside = set(ops)
    weights: dict[str, int] = {}
    received: dict[str, int] = {}
    reread: dict[str, int] = {}
    workspace = 0
    for op in ops:
        attrs = G.nodes[op]
        weights.update(attrs["weights"])
        workspace = max(workspace, attrs["workspace_bytes"])
        for t in attrs["inputs"]:
            if uses[t].producer not in inside:
                received[t] = uses[t].nbytes
                if attrs.get("rereads_inputs"):
                    reread[t] = uses[t].nbytes
    live = 0
    peak = 0
    last_use = {}
    for op in ops:
        for t in G.nodes[op]["outputs"]:
            last_use[t] = _last_use(uses[t], pos)
    freeing: dict[float, int] = {}  # last reader's position (inf: a graph output) → bytes freed
    for t, at in last_use.items():
        freeing[at] = freeing.get(at, 0) + uses[t].nbytes
    for op in ops:
        p = pos[op]
        live += sum(uses[t].nbytes for t in G.nodes[op]["outputs"])
        peak = max(peak, live)
        live -= freeing.get(p, 0)
    staged = G.graph.get("staged_output_bytes")
    end = pos[ops[-1]] if ops else -1
    sent_copies = 0 if staged is None else sum(
        uses[t].nbytes for t, at in last_use.items() if at > end and uses[t].nbytes >= staged)
    return sum(weights.values()) + sum(received.values()) + sum(reread.values()) + sent_copies + workspace + peak


def _never_freed_bytes(G: nx.DiGraph, ops: Sequence[str]) -> int:
    uses = G.graph["tensors"]
    inside = set(ops)
    staged = G.graph.get("staged_output_bytes")
    weights: dict[str, int] = {}
    tensors: set[str] = set()
    copies: set[str] = set()  # staging copies, as chunk_peak_bytes counts them
    for op in ops:
        attrs = G.nodes[op]
        weights.update(attrs["weights"])
        tensors.update(attrs["inputs"], attrs["outputs"])
        if attrs.get("rereads_inputs"):
            copies.update(t for t in attrs["inputs"] if uses[t].producer not in inside)
        if staged is not None:
            copies.update(t for t in attrs["outputs"] if uses[t].nbytes >= staged
                          and (uses[t].is_output or any(c not in inside for c in uses[t].consumers)))
    workspace = max(G.nodes[op]["workspace_bytes"] for op in ops)
    return (sum(weights.values()) + sum(uses[t].nbytes for t in tensors) + sum(uses[t].nbytes for t in copies)
            + workspace)


def _last_use(use, pos: dict[str, int]) -> float:
    if use.is_output:
        return float("inf")
    if not use.consumers:
        return pos[use.producer]
    return max(pos[c] for c in use.consumers)


def build_plan(
    G: nx.DiGraph,
    member_of: dict[str, str],
    members: Sequence[Member],
    *,
    objective: str = "latency",
    algorithm: str = "",
    solve_time_s: float = 0.0,
    replicas: Sequence[str] = (),
) -> Plan:
    """Prices an assignment (op → member id) with the model in the module docstring; O(ops + reads)."""
    by_id = {m.id: m for m in members}
    order = G.graph["order"]
    pos = positions(G)
    uses = G.graph["tensors"]
    chunks: list[Chunk] = []
    chunk_of: dict[str, int] = {}
    for op in order:
        member = member_of[op]
        if not chunks or chunks[-1].member != member:
            chunks.append(Chunk(len(chunks), member, []))
        chunks[-1].ops.append(op)
        chunk_of[op] = chunks[-1].index

    transfers: list[Transfer] = []
    for t, use in uses.items():
        if use.producer is None:
            continue
        src = member_of[use.producer]
        first_reader: dict[str, str] = {}
        for c in sorted(use.consumers, key=pos.__getitem__):
            if member_of[c] != src:
                first_reader.setdefault(member_of[c], c)
        for dst, reader in first_reader.items():
            transfers.append(Transfer(t, use.nbytes, src, dst, chunk_of[use.producer], chunk_of[reader]))

    for chunk in chunks:
        cost = by_id[chunk.member].cost
        inside = set(chunk.ops)
        preds: set[int] = set()
        up: dict[str, int] = {}
        down: dict[str, int] = {}
        for op in chunk.ops:
            attrs = G.nodes[op]
            chunk.compute_ps += cost.op_ps(attrs["flops"], attrs["bytes_read"] + attrs["bytes_written"])
            for t in attrs["inputs"]:
                producer = uses[t].producer
                if producer is None or member_of[producer] != chunk.member:
                    up[t] = uses[t].nbytes
                if producer is not None and producer not in inside:
                    preds.add(chunk_of[producer])
            for t in attrs["outputs"]:
                use = uses[t]
                if use.is_output or any(member_of[c] != chunk.member for c in use.consumers):
                    down[t] = use.nbytes
        chunk.preds = sorted(preds)
        chunk.upload_bytes, chunk.download_bytes = sum(up.values()), sum(down.values())
        chunk.upload_ps = cost.upload_ps(chunk.upload_bytes)
        chunk.download_ps = cost.download_ps(chunk.download_bytes)
        chunk.peak_bytes = chunk_peak_bytes(G, chunk.ops, pos)
    for chunk in chunks:
        for p in chunk.preds:
            chunks[p].succs.append(chunk.index)

    memory = {m.id: 0 for m in members}
    compute = {m.id: 0 for m in members}
    link = {m.id: 0 for m in members}
    for chunk in chunks:
        memory[chunk.member] += chunk.peak_bytes
        compute[chunk.member] += chunk.compute_ps
        link[chunk.member] += by_id[chunk.member].cost.link_busy_ps(chunk.upload_bytes, chunk.download_bytes)
    for member_id in memory:
        mine = [c for c in chunks if c.member == member_id]
        if len(mine) > 1:
            # summing chunk peaks counts a weight or tensor shared by chunks once per chunk; keeping
            # everything the member ever touches, never freed, is also an upper bound: take the lower
            memory[member_id] = min(memory[member_id], _never_freed_bytes(G, [op for c in mine for op in c.ops]))
    latency_ps = sum(c.time_ps for c in chunks)
    period_ps = max(max(compute[m], link[m]) for m in compute)
    throughput = PS_PER_S / period_ps if period_ps else float("inf")
    for replica in replicas:
        single = build_plan(G, {op: replica for op in order}, members)
        memory[replica] = single.memory_bytes[replica]
        throughput += single.throughput_per_s
    return Plan(member_of=dict(member_of), chunks=chunks, transfers=transfers, memory_bytes=memory,
                budget_bytes={m.id: m.budget_bytes for m in members}, latency_s=latency_ps / PS_PER_S,
                throughput_per_s=throughput, objective=objective, algorithm=algorithm,
                solve_time_s=solve_time_s, replicas=list(replicas))


def plan_problems(G: nx.DiGraph, plan: Plan) -> list[str]:
    """Everything wrong with ``plan`` for ``G`` (empty when valid); see :func:`is_valid_plan`."""
    problems: list[str] = []
    ops = list(G.graph["order"])
    placed = [op for c in plan.chunks for op in c.ops]
    if sorted(placed) != sorted(ops) or set(plan.member_of) != set(ops):
        problems.append("not every op is placed exactly once")
    for c in plan.chunks:
        if any(plan.member_of.get(op) != c.member for op in c.ops):
            problems.append(f"chunk {c.index} holds ops of another member")
    for member, used in plan.memory_bytes.items():
        if used > plan.budget_bytes.get(member, -1):
            problems.append(f"member {member}: {used} bytes exceed its budget {plan.budget_bytes.get(member)}")
    moved = {(t.tensor, t.dst) for t in plan.transfers}
    if len(moved) != len(plan.transfers):
        problems.append("a tensor is transferred twice to the same member")
    for u, v, data in G.edges(data=True):
        mu, mv = plan.member_of.get(u), plan.member_of.get(v)
        if mu != mv:
            for t in data["tensors"]:
                if (t, mv) not in moved:
                    problems.append(f"tensor {t} read by {v} on {mv} has no transfer from {mu}")
    if not nx.is_directed_acyclic_graph(plan.chunk_dag()):
        problems.append("the chunk graph has a cycle")
    return problems


def is_valid_plan(G: nx.DiGraph, plan: Plan) -> bool:
    """True when every op is placed once, every member is within budget, every tensor crossing
    members has a transfer (once per destination) and the chunk graph is acyclic."""
    return not plan_problems(G, plan)

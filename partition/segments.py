"""Costs of every contiguous segment ``[i, e)`` of the topological order, a column at a time.

For a fixed end ``e`` the DP needs, for every start ``i < e``, the segment's peak memory, its
upload and download bytes, its compute time per member and the bytes it receives from other
segments. Each quantity changes from ``e`` to ``e + 1`` by a range update over ``i`` (a tensor
starts or stops counting for all starts up to some position), so a column costs O(n) numpy work
per tensor use: O(n · (n + uses)) for all columns, without the O(n²) per-segment Python loops
of the direct definition in :func:`vkpool.partition.plan.chunk_peak_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import networkx as nx
import numpy as np

from vkpool.partition.cost import Member, MemberCost
from vkpool.partition.graph import positions


@dataclass
class Column:
    """Vectors over the start ``i`` (length ``end``) for segments ``[i, end)``."""

    end: int
    peak: np.ndarray  # bytes
    up_bytes: np.ndarray  # tensors read from before i (graph inputs included)
    cross_bytes: np.ndarray  # the part of up_bytes produced by other segments
    down_bytes: np.ndarray  # tensors written and read after end, or graph outputs
    compute_ps: list[np.ndarray]  # per distinct member cost, in the order of ``cost_groups``


def cost_groups(members: Sequence[Member]) -> tuple[list[MemberCost], np.ndarray]:
    """The distinct costs among ``members`` and, per member, the index of its own: members of
    equal speeds (identical GPUs, splits of one) are priced once."""
    distinct: list[MemberCost] = []
    index = []
    for m in members:
        if m.cost not in distinct:
            distinct.append(m.cost)
        index.append(distinct.index(m.cost))
    return distinct, np.array(index, np.int64)


def columns(G: nx.DiGraph, members: Sequence[Member]) -> Iterator[Column]:
    """Yields the column of every end ``e = 1 .. n`` in order. O(n·(n + uses)) in total."""
    order = G.graph["order"]
    uses = G.graph["tensors"]
    pos = positions(G)
    n = len(order)
    weights = np.zeros(n, np.int64)
    up = np.zeros(n, np.int64)
    cross = np.zeros(n, np.int64)
    down = np.zeros(n, np.int64)
    staged = G.graph.get("staged_output_bytes")
    copies = np.zeros(n, np.int64)  # the engine's staging copies (see plan.chunk_peak_bytes)
    last_reread: dict[str, int] = {}  # tensor → its latest re-reading reader so far
    workspace = np.zeros(n, np.int64)
    live = np.zeros(n, np.int64)
    act = np.zeros(n, np.int64)
    last_seen: dict[str, int] = {}  # tensor → its latest reader so far
    freed_at: dict[int, list[tuple[int, int]]] = {}  # position → (producer pos, bytes) freed after it
    down_ends: dict[int, list[tuple[int, int, bool]]] = {}  # last reader → (producer pos, bytes, copied)
    prefix = []
    for cost in cost_groups(members)[0]:
        times = [cost.op_ps(G.nodes[op]["flops"], G.nodes[op]["bytes_read"] + G.nodes[op]["bytes_written"])
                 for op in order]
        prefix.append(np.concatenate([[0], np.cumsum(np.asarray(times, np.int64))]))

    for j, op in enumerate(order):
        attrs = G.nodes[op]
        for t, b in attrs["weights"].items():
            start = last_seen.get(t, -1) + 1
            weights[start:j + 1] += b
            last_seen[t] = j
        for t in attrs["inputs"]:
            use = uses[t]
            p = -1 if use.producer is None else pos[use.producer]
            start = max(p, last_seen.get(t, -1)) + 1
            up[start:j + 1] += use.nbytes
            if use.producer is not None:
                cross[start:j + 1] += use.nbytes
            if attrs.get("rereads_inputs"):
                copies[max(p, last_reread.get(t, -1)) + 1:j + 1] += use.nbytes
                last_reread[t] = j
            last_seen[t] = j
        # tensors whose last reader is j stop leaving segments that end after j
        for p, b, copied in down_ends.pop(j, ()):
            down[:p + 1] -= b
            if copied:
                copies[:p + 1] -= b
        for t in attrs["outputs"]:
            use = uses[t]
            last = max((pos[c] for c in use.consumers), default=j)
            if use.is_output or last > j:
                down[:j + 1] += use.nbytes
                copied = staged is not None and use.nbytes >= staged
                if copied:
                    copies[:j + 1] += use.nbytes
                if not use.is_output:
                    down_ends.setdefault(last, []).append((j, use.nbytes, copied))
            live[:j + 1] += use.nbytes
            if not use.is_output:
                freed_at.setdefault(last, []).append((j, use.nbytes))
        np.maximum(workspace[:j + 1], attrs["workspace_bytes"], out=workspace[:j + 1])
        np.maximum(act[:j + 1], live[:j + 1], out=act[:j + 1])
        for p, b in freed_at.pop(j, ()):
            live[:p + 1] -= b
        e = j + 1
        peak = weights[:e] + up[:e] + copies[:e] + act[:e] + workspace[:e]
        yield Column(e, peak, up[:e].copy(), cross[:e].copy(), down[:e].copy(),
                     [pre[e] - pre[:e] for pre in prefix])

"""A loaded model as a networkx DiGraph carrying what the partitioner prices.

Nodes are ops, keyed by a unique name, with attributes

- ``op_type``, ``index`` (position in the model's topological order);
- ``flops``, ``bytes_read``, ``bytes_written``, ``workspace_bytes``;
- ``weights``: ``{constant name: bytes}`` of the constants it reads (a constant read by several
  ops is stored once per member, so memory sums these as a set);
- ``inputs``/``outputs``: the tensor names it reads and writes (constants excluded from inputs);
- ``cost_source``: ``"registry"`` when the op class answered, else ``"estimate"``.

An edge ``u → v`` exists when ``v`` reads a tensor ``u`` writes; ``tensors`` maps those tensor
names to their bytes and ``bytes`` is their sum. ``G.graph`` holds ``order`` (the topological
order), ``tensors`` (name → :class:`TensorUse`), ``inputs`` and ``outputs`` (graph tensor names).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import networkx as nx
import numpy as np

from vkpool.kernels.base import TensorInfo

if TYPE_CHECKING:
    from vkpool.model import LoadedModel, Node


@dataclass
class TensorUse:
    """Where a tensor comes from and goes: ``producer`` is None for graph inputs and constants."""

    nbytes: int
    producer: str | None = None
    consumers: list[str] = field(default_factory=list)
    is_output: bool = False
    is_constant: bool = False


def build_graph(model: LoadedModel) -> nx.DiGraph:
    """The op graph of ``model`` with costs; ``O(ops + tensor uses)`` plus one registry call per op."""
    G = nx.DiGraph()
    uses: dict[str, TensorUse] = {}
    for name, value in model.constants.items():
        uses[name] = TensorUse(int(value.nbytes), is_constant=True)
    for name, info in model.inputs:
        uses[name] = TensorUse(info.nbytes)
    order: list[str] = []
    taken: set[str] = set()
    for index, node in enumerate(model.nodes):
        key = node.name if node.name and node.name not in taken else f"{node.op_type}_{index}"
        while key in taken:
            key += "_"
        taken.add(key)
        order.append(key)
        cost = op_cost(node, model)
        weights = {t: uses[t].nbytes for t in node.inputs if t in model.constants}
        inputs = list(dict.fromkeys(t for t in node.inputs if t and t not in model.constants))
        outputs = [t for t in node.outputs if t]
        G.add_node(key, op_type=node.op_type, index=index, weights=weights, inputs=inputs,
                   outputs=outputs, **cost)
        for t in dict.fromkeys(t for t in node.inputs if t):
            uses[t].consumers.append(key)
            producer = uses[t].producer
            if producer is not None:
                if not G.has_edge(producer, key):
                    G.add_edge(producer, key, tensors={}, bytes=0)
                edge = G.edges[producer, key]
                edge["tensors"][t] = uses[t].nbytes
                edge["bytes"] += uses[t].nbytes
        for t in outputs:
            uses[t] = TensorUse(model.tensors[t].nbytes, producer=key)
    for name, _ in model.outputs:
        uses[name].is_output = True
    from vkpool.engine import STAGED_OUTPUT_BYTES

    G.graph.update(order=order, tensors=uses, inputs=[n for n, _ in model.inputs],
                   outputs=[n for n, _ in model.outputs], staged_output_bytes=STAGED_OUTPUT_BYTES)
    return G


def op_cost(node: Node, model: LoadedModel) -> dict[str, Any]:
    """FLOPs, bytes and workspace of ``node``: from its op class when the registry has one, else
    :func:`estimate_cost`."""
    from vkpool.kernels import registry

    infos = [model.tensors[t] if t else None for t in node.inputs]
    constants = {i: model.constants[t] for i, t in enumerate(node.inputs) if t in model.constants}
    try:
        op = registry.create_op(node.op_type, node.attrs, infos, constants, domain=node.domain,
                                opset=model.opset, num_outputs=len(node.outputs))
        return {"flops": int(op.flops()), "bytes_read": int(op.bytes_read()),
                "bytes_written": int(op.bytes_written()), "workspace_bytes": int(op.workspace_bytes()),
                "rereads_inputs": bool(op.rereads_inputs), "cost_source": "registry"}
    except Exception:  # no class yet, or one that rejects this node: price it by formula instead
        outs = [model.tensors[t] for t in node.outputs if t]
        return {**estimate_cost(node.op_type, node.attrs, infos, outs), "cost_source": "estimate"}


def estimate_cost(
    op_type: str, attrs: dict[str, Any], inputs: list[TensorInfo | None], outputs: list[TensorInfo]
) -> dict[str, int]:
    """Cost of an op without a registry class.

    - MatMul ``[..., M, K] @ [..., K, N]``: ``2·K`` FLOPs per output element;
    - Gemm: ``2·K`` per output element plus one per element for the ``C`` term;
    - Conv: ``2·(C_in/group)·prod(kernel)`` per output element, plus one for the bias;
    - anything else: one FLOP per output element (elementwise ops, copies, reductions' output).

    Bytes read are the inputs' bytes, bytes written the outputs', workspace zero.
    """
    out_elems = sum(o.size for o in outputs)
    first = inputs[0] if inputs else None
    if op_type == "MatMul" and first is not None and first.shape:
        flops = 2 * first.shape[-1] * out_elems
    elif op_type == "Gemm" and first is not None and len(first.shape) == 2:
        k = first.shape[0] if attrs.get("transA", 0) else first.shape[1]
        flops = 2 * k * out_elems + (out_elems if len(inputs) > 2 and inputs[2] is not None else 0)
    elif op_type == "Conv" and len(inputs) > 1 and inputs[1] is not None:
        w = inputs[1].shape  # [C_out, C_in/group, k...]
        flops = 2 * math.prod(w[1:]) * out_elems + (out_elems if len(inputs) > 2 and inputs[2] else 0)
    else:
        flops = out_elems
    return {
        "flops": int(flops),
        "bytes_read": int(sum(i.nbytes for i in inputs if i is not None)),
        "bytes_written": int(sum(o.nbytes for o in outputs)),
        "workspace_bytes": 0,
    }


def positions(G: nx.DiGraph) -> dict[str, int]:
    """Op → its position in ``G.graph['order']``."""
    return {op: i for i, op in enumerate(G.graph["order"])}


def random_dag(n_ops: int, seed: int, *, max_bytes: int = 1 << 20) -> nx.DiGraph:
    """A random op graph in the shape :func:`build_graph` returns, for tests and benchmarks.

    Op ``k`` reads one to three earlier tensors (or the graph input), may read a constant, and
    writes one tensor; the last op's tensor and any unread tensor are graph outputs.
    """
    rng = np.random.default_rng(seed)
    G = nx.DiGraph()
    uses: dict[str, TensorUse] = {"x": TensorUse(int(rng.integers(1, max_bytes)))}
    order = []
    for k in range(n_ops):
        op = f"op{k}"
        order.append(op)
        pool = ["x"] + [f"t{i}" for i in range(max(0, k - 6), k)]
        reads = list(dict.fromkeys(rng.choice(pool, size=int(rng.integers(1, 4))).tolist()))
        weights = {}
        if rng.random() < 0.6:
            shared = f"w{int(rng.integers(0, max(1, n_ops // 2)))}"
            uses.setdefault(shared, TensorUse(int(rng.integers(1, max_bytes)), is_constant=True))
            weights[shared] = uses[shared].nbytes
            uses[shared].consumers.append(op)
        out = f"t{k}"
        uses[out] = TensorUse(int(rng.integers(1, max_bytes)), producer=op)
        G.add_node(op, op_type="Random", index=k, weights=weights, inputs=reads, outputs=[out],
                   flops=int(rng.integers(1, 10**9)), bytes_read=sum(uses[t].nbytes for t in reads),
                   bytes_written=uses[out].nbytes, workspace_bytes=int(rng.integers(0, max_bytes // 4)),
                   rereads_inputs=bool(rng.random() < 0.3), cost_source="estimate")
        for t in reads:
            uses[t].consumers.append(op)
            producer = uses[t].producer
            if producer is not None:
                if not G.has_edge(producer, op):
                    G.add_edge(producer, op, tensors={}, bytes=0)
                G.edges[producer, op]["tensors"][t] = uses[t].nbytes
                G.edges[producer, op]["bytes"] += uses[t].nbytes
    outputs = [t for t, u in uses.items() if u.producer is not None and not u.consumers]
    for t in outputs:
        uses[t].is_output = True
    G.graph.update(order=order, tensors=uses, inputs=["x"], outputs=outputs, staged_output_bytes=max_bytes // 2)
    return G

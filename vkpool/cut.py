"""Where a model is cut for data-dependent shapes, and what binding values there makes constant.

The analysis half of :mod:`vkpool.dynamic`: :func:`find_cut` splits a graph into the prefix
(nodes that depend on no tensor whose values fix a shape) and the suffix, naming the cut points;
:func:`resolve` binds the values read at those points and folds what became constant on the
host, so that every shape of the suffix is known.

Control flow cuts the same way: an If's condition is a cut point, and :func:`resolve` replaces
an If whose condition it knows by the branch taken; a Loop, a Scan or a NonMaxSuppression is
always cut before (``Split.host``), to run on the values read back (:mod:`vkpool.control_flow`).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vkpool.kernels.base import OpError, TensorInfo, UnsupportedOp
from vkpool.kernels.registry import create_op, op_class
from vkpool.model import NONDETERMINISTIC, LoadedModel, ModelError, Node, evaluate_node, to_node
from vkpool.subgraph import all_names, inline_branch, is_graph

#: once values are bound, a suffix node whose inputs are all constants is evaluated on the host
#: when its outputs take at most this many bytes; a larger one runs on the device
FOLD_BYTES = 16 << 20
# never folded: ops whose results are not a function of their inputs, and Dropout (whose
# training mode draws a mask)
_UNFOLDABLE = NONDETERMINISTIC | {"Dropout"}
#: ops run at a cut on the values read back there (:mod:`vkpool.control_flow`), never as kernels
HOST_OPS = frozenset({"Loop", "Scan", "NonMaxSuppression"})


def is_host_op(node: Node) -> bool:
    return node.op_type in HOST_OPS and node.domain in ("", "ai.onnx")


@dataclass(frozen=True)
class CutPoint:
    """Input ``position`` of node ``node``: a tensor whose values fix a shape."""

    node: str
    op_type: str
    position: int
    tensor: str
    input_name: str  # the input's name in the op's schema: K, shape, limit, ...
    output: str  # the node's first output

    def describe(self) -> str:
        if self.position < 0:
            return f"{self.op_type} '{self.node}' (run on the values read back)"
        return f"{self.input_name} of {self.op_type} '{self.node}'"


@dataclass
class Graph:
    """A model or part of one: a :class:`~vkpool.model.LoadedModel` whose ``tensors`` hold infos
    only for the tensors whose shapes are known."""

    inputs: list[tuple[str, TensorInfo]]
    outputs: list[str]
    nodes: list[Node]
    constants: dict[str, np.ndarray]
    tensors: dict[str, TensorInfo]
    opset: int

    @classmethod
    def of(cls, model: LoadedModel) -> Graph:
        return cls(list(model.inputs), [n for n, _ in model.outputs], list(model.nodes), model.constants,
                   model.tensors, model.opset)

    def static(self) -> LoadedModel:
        """This graph as a static model; every tensor's info must be known."""
        return LoadedModel(inputs=list(self.inputs), outputs=[(n, self.tensors[n]) for n in self.outputs],
                           nodes=list(self.nodes), constants=self.constants, tensors=dict(self.tensors),
                           opset=self.opset)


@dataclass
class Split:
    """Where a graph is cut: ``prefix`` (no dependence on a point), the ``points`` right after
    it, and the ``suffix`` (every other node, in graph order)."""

    prefix: list[Node]
    suffix: list[Node]
    points: list[CutPoint]
    #: suffix nodes that need values the suffix computes: it is cut again once compiled
    later: int
    #: Loops, Scans and NonMaxSuppressions run right after the prefix (position -1 in ``points``)
    host: list[Node] = field(default_factory=list)


def node_label(node: Node) -> str:
    return node.name or f"{node.op_type}:{next((o for o in node.outputs if o), '?')}"


def missing_constants(node: Node, constants: dict[str, np.ndarray]) -> list[int]:
    """Input positions whose values the node's kernel needs and ``constants`` lacks."""
    positions = op_class(node.op_type, node.domain).constant_inputs
    inputs = node.inputs
    return [p for p in positions if p < len(inputs) and inputs[p] and inputs[p] not in constants]


def _input_name(node: Node, position: int, opset: int) -> str:
    import onnx.defs

    try:
        formal = onnx.defs.get_schema(node.op_type, opset, node.domain).inputs
    except onnx.defs.SchemaError:
        formal = []
    if position < len(formal):
        return str(formal[position].name)
    return f"input {position}"


def find_cut(graph: Graph) -> Split | None:
    """The cut of ``graph`` at the points whose values are not known, or None where there is
    none. One pass over the nodes: a node is in the suffix when it needs such a value or reads a
    tensor the suffix produces. Every such value the prefix (or an input) provides is a point; a
    value the suffix computes waits for the suffix's own cut. Raises :class:`ModelError` when a
    prefix tensor's shape is unknown."""
    dependent: set[str] = set()
    prefix: list[Node] = []
    suffix: list[Node] = []
    points: list[CutPoint] = []
    host: list[Node] = []
    later = 0
    for node in graph.nodes:
        missing = missing_constants(node, graph.constants)
        blocked = any(t in dependent for t in node.inputs if t)
        if is_host_op(node):
            if blocked:
                later += 1
            else:
                host.append(node)
                points.append(CutPoint(node_label(node), node.op_type, -1, "", "inputs",
                                       next((o for o in node.outputs if o), "")))
            suffix.append(node)
            dependent.update(o for o in node.outputs if o)
            continue
        if not missing and not blocked:
            prefix.append(node)
            continue
        ready = [p for p in missing if node.inputs[p] not in dependent]
        later += len(ready) < len(missing)
        points += [CutPoint(node_label(node), node.op_type, pos, node.inputs[pos],
                            _input_name(node, pos, graph.opset), next((o for o in node.outputs if o), ""))
                   for pos in ready]
        suffix.append(node)
        dependent.update(o for o in node.outputs if o)
    if not points:
        return None
    names = [n for n, _ in graph.inputs] + [t for node in prefix for t in (*node.inputs, *node.outputs)]
    unknown = next((n for n in names if n and n not in graph.tensors and n not in graph.constants), None)
    if unknown is not None:
        raise ModelError(f"tensor {unknown!r}: shape or dtype is still unknown after binding symbolic dims")
    return Split(prefix, suffix, points, later, host)


def resolve(graph: Graph) -> Graph:
    """``graph`` with what its constants now fix: the infos of every tensor whose shape is known,
    nodes whose inputs are all constants folded on the host (up to :data:`FOLD_BYTES`), Shape and
    Size of known shapes folded. Nodes that depend on a still unknown value are kept as they are."""
    infos = dict(graph.tensors)
    constants = dict(graph.constants)
    for name, value in constants.items():
        infos[name] = TensorInfo(value.shape, value.dtype)
    blocked: set[str] = set()
    kept: list[Node] = []
    taken: set[str] | None = None
    pending = deque(graph.nodes)
    while pending:
        node = pending.popleft()
        if node.op_type == "If" and node.inputs[0] in constants:
            if taken is None:
                taken = _names_in_use(graph, infos, constants)
            inlined, values = _inline_if(node, constants[node.inputs[0]], taken)
            constants.update(values)
            infos.update((k, TensorInfo(v.shape, v.dtype)) for k, v in values.items())
            pending.extendleft(reversed(inlined))
            continue
        if (is_host_op(node) or any(t in blocked for t in node.inputs if t)
                or missing_constants(node, constants)):
            blocked.update(o for o in node.outputs if o)
            kept.append(node)
            continue
        try:
            op = create_op(node.op_type, node.attrs, [infos[t] if t else None for t in node.inputs],
                           {i: constants[t] for i, t in enumerate(node.inputs) if t and t in constants},
                           domain=node.domain, opset=graph.opset, num_outputs=len(node.outputs))
        except UnsupportedOp:
            # no kernel for these types, but the values are all known: evaluated as the loader folds
            folded = _fold_with_onnx(node, constants, graph.opset)
            if folded is None:
                raise
            for name, value in zip(node.outputs, folded):
                if name:
                    constants[name] = value
                    infos[name] = TensorInfo(value.shape, value.dtype)
            continue
        outs = op.output_infos()
        for name, info in zip(node.outputs, outs):
            if name and any(d < 0 for d in info.shape):
                raise OpError(f"node {node_label(node)}: output {name!r} would have shape {list(info.shape)}")
        values = _fold(node, op, outs, constants)
        if values is None:
            kept.append(node)
        for name, info, value in zip(node.outputs, outs, values or [None] * len(outs)):
            if name:
                infos[name] = info
                if value is not None:
                    constants[name] = value
    used = {t for node in kept for t in node.inputs if t} | set(graph.outputs)
    kept_constants = {k: v for k, v in constants.items() if k in used}
    return Graph(list(graph.inputs), list(graph.outputs), kept, kept_constants, infos, graph.opset)


def _names_in_use(graph: Graph, infos: dict[str, TensorInfo], constants: dict[str, np.ndarray]) -> set[str]:
    taken = set(infos) | set(constants) | {t for n in graph.nodes for t in (*n.inputs, *n.outputs)}
    for node in graph.nodes:
        for value in node.attrs.values():
            if is_graph(value):
                taken |= all_names(value)
    return taken


def _inline_if(node: Node, cond: np.ndarray, taken: set[str]) -> tuple[list[Node], dict[str, np.ndarray]]:
    """The nodes of the branch an If takes for ``cond``, renamed (:func:`vkpool.subgraph.inline_branch`)."""
    branch = node.attrs["then_branch" if bool(np.asarray(cond).reshape(-1)[0]) else "else_branch"]
    protos, values = inline_branch(node.name, node.outputs, branch, taken)
    return [to_node(p) for p in protos], values


def _fold(node: Node, op: Any, outs: list[TensorInfo], constants: dict[str, np.ndarray]) -> list[Any] | None:
    present = [t for t in node.inputs if t]
    if node.op_type in _UNFOLDABLE or sum(o.nbytes for o in outs) > FOLD_BYTES:
        return None
    if node.op_type not in ("Shape", "Size") and not all(t in constants for t in present):
        return None
    try:
        results = op.reference([constants.get(t) if t else None for t in node.inputs])
    except Exception:  # a reference that cannot evaluate these values leaves the node to its kernel
        return None
    values = []
    for info, result in zip(outs, results):
        value = np.asarray(result)
        if value.shape != info.shape:
            return None
        values.append(value.astype(info.dtype, copy=False))
    return values


def _fold_with_onnx(node: Node, constants: dict[str, np.ndarray], opset: int) -> list[np.ndarray] | None:
    """The outputs of a node whose inputs are all constants, by onnx's ReferenceEvaluator (as
    :mod:`vkpool.model` folds at load); None where that cannot evaluate it."""
    present = [t for t in node.inputs if t]
    if node.op_type in _UNFOLDABLE or not all(t in constants for t in present):
        return None
    import onnx
    from onnx import helper, numpy_helper

    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
        attrs = []
        for key, value in node.attrs.items():
            if isinstance(value, np.ndarray):
                value = numpy_helper.from_array(value)
            elif isinstance(value, list) and value and isinstance(value[0], np.ndarray):
                value = [numpy_helper.from_array(v) for v in value]
            kind = int(schema.attributes[key].type.value) if isinstance(value, list) and not value else None
            attrs.append(helper.make_attribute(key, value, attr_type=kind))
        proto = helper.make_node(node.op_type, node.inputs, node.outputs, domain=node.domain)
        proto.attribute.extend(attrs)
        results = evaluate_node(proto, constants, [helper.make_opsetid(node.domain, opset)])
        return [np.asarray(r) if o else np.zeros(0) for o, r in zip(node.outputs, results)]
    except Exception:  # anything the reference cannot do stays the kernel's refusal
        return None

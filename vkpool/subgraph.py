"""Subgraphs of control-flow nodes (If, Loop, Scan): the names they read from outer scopes, and
the inlining of an If's chosen branch into the graph around it.

A subgraph stays an ``onnx.GraphProto`` (a :class:`~vkpool.model.Node`'s attribute) until it is
inlined (If) or compiled as a part of its own (a Loop's or a Scan's body,
:mod:`vkpool.control_flow`). The outer-scope names a subgraph reads are appended to its node's
inputs when the node is loaded (:func:`formal_inputs` tells how many come first), so that every
pass that orders nodes or follows tensors (the cut, the folding, the prefix's outputs) sees them
as what they are: inputs of that node.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:
    import onnx


def is_graph(value: Any) -> bool:
    """Whether a loaded node's attribute value is a subgraph (checked without importing onnx)."""
    return type(value).__name__ == "GraphProto"


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The subgraphs in the attributes of ``node``."""
    import onnx

    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def outer_names(graph: onnx.GraphProto) -> list[str]:
    """Names ``graph`` reads (its nodes, its nested subgraphs, its outputs) that it does not
    define: the values it takes from the scopes around it, in first-use order."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined |= {s.values.name for s in graph.sparse_initializer}
    out: dict[str, None] = {}
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                out[name] = None
        for sub in subgraphs(node):
            for name in outer_names(sub):
                if name not in defined:
                    out[name] = None
        defined.update(o for o in node.output if o)
    for value in graph.output:
        if value.name not in defined:
            out[value.name] = None
    return list(out)


def node_outer_names(node: onnx.NodeProto) -> list[str]:
    """The outer-scope names the subgraphs of ``node`` read."""
    return list(dict.fromkeys(n for sub in subgraphs(node) for n in outer_names(sub)))


def all_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name of ``graph`` and of its subgraphs, at any depth."""
    names = {i.name for i in graph.input} | {o.name for o in graph.output} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for sub in subgraphs(node):
            names |= all_names(sub)
    names.discard("")
    return names


def subgraph_op_types(graph: onnx.GraphProto) -> list[tuple[str, str]]:
    """``(op_type, domain)`` of the nodes of ``graph`` and of its subgraphs, at any depth."""
    out = []
    for node in graph.node:
        out.append((node.op_type, node.domain))
        for sub in subgraphs(node):
            out += subgraph_op_types(sub)
    return out


def formal_inputs(op_type: str, attrs: dict[str, Any], inputs: list[str], opset: int) -> int:
    """How many of a loaded node's ``inputs`` are the op's own; the rest are outer-scope names
    its subgraphs read."""
    if op_type == "If":
        return 1
    if op_type == "Loop":
        return len(attrs["body"].input)
    if op_type == "Scan":  # opset 8's Scan takes sequence_lens first
        return len(attrs["body"].input) + (1 if opset < 9 else 0)
    return len(inputs)


def fresh(name: str, taken: set[str]) -> str:
    """``name@1``, ``name@2``, ...: the first not in ``taken`` (then added to it)."""
    k = 1
    while f"{name}@{k}" in taken:
        k += 1
    out = f"{name}@{k}"
    taken.add(out)
    return out


def inline_branch(name: str, outputs: list[str], branch: onnx.GraphProto, taken: set[str]
                  ) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
    """The nodes that replace If ``name`` (of ``outputs``) when ``branch`` is the one taken, and the branch's
    initializers as constants. Every name the branch defines is renamed to one not in ``taken``
    (the names of the whole model, updated), so that branches of different Ifs never clash once
    inlined; references to those names from nested subgraphs follow. The If's outputs are
    produced by the branch's nodes themselves, or by an Identity where the branch passes an
    outer value, a constant or one value twice."""
    from onnx import helper, numpy_helper

    renames: dict[str, str] = {}
    constants: dict[str, np.ndarray] = {}
    for init in branch.initializer:
        renames[init.name] = fresh(init.name, taken)
        constants[renames[init.name]] = numpy_helper.to_array(init)
    produced = [o for n in branch.node for o in n.output if o]
    for value_name in produced:
        renames[value_name] = fresh(value_name, taken)
    # a branch output made by one of its nodes takes the If's output name directly
    tail: list[onnx.NodeProto] = []
    for value, target in zip(branch.output, outputs):
        if not target:
            continue
        if value.name in produced and renames[value.name] not in outputs:
            renames[value.name] = target
        else:
            tail.append(helper.make_node("Identity", [renames.get(value.name, value.name)], [target],
                                         name=f"{name or target}/output"))
    nodes = [_renamed(n, renames) for n in branch.node]
    return nodes + tail, constants


def _renamed(node: onnx.NodeProto, renames: dict[str, str]) -> onnx.NodeProto:
    import onnx

    out = onnx.NodeProto()
    out.CopyFrom(node)
    _rename_node(out, renames)
    return out


def _rename_node(node: onnx.NodeProto, renames: dict[str, str]) -> None:
    for i, name in enumerate(node.input):
        node.input[i] = renames.get(name, name)
    for i, name in enumerate(node.output):
        node.output[i] = renames.get(name, name)
    for sub in subgraphs(node):
        _rename_references(sub, renames)


def _rename_references(graph: onnx.GraphProto, renames: dict[str, str]) -> None:
    """Renames the outer-scope references of a nested subgraph; a name it defines itself (one
    that shadows an outer name) stays its own."""
    local = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    local |= {o for n in graph.node for o in n.output}
    if local & renames.keys():
        renames = {k: v for k, v in renames.items() if k not in local}
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = renames.get(name, name)
        for sub in subgraphs(node):
            _rename_references(sub, renames)
    for value in graph.output:
        value.name = renames.get(value.name, value.name)


def initializers(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """The initializers of ``graph`` as arrays, by name."""
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in graph.initializer}

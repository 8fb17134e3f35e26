"""Dividing a product too large for the members' budgets into products over column blocks.

A plan places whole ops, so one product whose weights take most of a member's budget pins the
plan: every member that holds it holds little else, and the cut that would divide the time
evenly may not fit. Before a model is planned over several members, each ``MatMul`` or ``Gemm``
whose constant 2-D weight is larger than half the largest member's budget becomes ``k``
products over blocks of its output columns, joined by a ``Concat`` on the last axis::

    Y = A·W      →   Y = Concat(A·W[:, 0:n1], A·W[:, n1:n2], …)

with ``k = ceil(weight bytes / limit)``, so each block's weights fit the limit. The planner then
places the blocks like any other ops: on one member, or on several with the product's input
crossing to each (:mod:`vkpool.partition`). Every output column is computed by the same kernel
from the same row and column as before, so results are those of the whole product.

A block keeps the product's attributes (``alpha``, ``beta``, ``transB``, vkpool's fused
``activation``); a constant bias (Gemm's C, or the one :mod:`vkpool.fusion` gives a MatMul) with one value per column is divided with the columns, and one that broadcasts
along them is given whole to each block. A product with a bias computed at run time, or with
fewer columns than blocks, is left whole. The blocks are named ``NAME/cols<i>`` and the join
``NAME/join`` (``NAME`` the node's name, else its output's), as ``Session.plan`` shows them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Mapping, Sequence

import numpy as np

from vkpool.kernels.base import TensorInfo
from vkpool.model import Node

if TYPE_CHECKING:
    from vkpool.model import LoadedModel

# below this many columns per block a product is not divided further: a block that narrow
# leaves the kernel's workgroups short of rows
MIN_BLOCK_COLUMNS = 64


def _weight(model: LoadedModel, node: Node) -> tuple[np.ndarray, bool] | None:
    """The product's constant 2-D weight and whether its rows are the output columns."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return None
    weight = model.constants.get(node.inputs[1])
    if weight is None or weight.ndim != 2 or weight.dtype not in (np.float32, np.float16):
        return None
    if node.inputs[0] in model.constants or node.outputs[0] not in model.tensors:
        return None
    by_rows = node.op_type == "Gemm" and bool(node.attrs.get("transB", 0))
    if len(node.inputs) > 2 and node.inputs[2]:  # Gemm's C, or the bias vkpool.fusion gave a MatMul
        columns = weight.shape[0 if by_rows else 1]
        bias = model.constants.get(node.inputs[2])
        if bias is None and model.tensors[node.inputs[2]].shape[-1:] == (columns,) and columns > 1:
            return None  # a bias computed at run time with a value per column: left whole
    return weight, by_rows


def wide_products(model: LoadedModel, limit_bytes: int) -> dict[str, int]:
    """Products of ``model`` whose weight exceeds ``limit_bytes``: node name → number of blocks."""
    out: dict[str, int] = {}
    if limit_bytes <= 0:
        return out
    for node in model.nodes:
        found = _weight(model, node)
        if found is None or found[0].nbytes <= limit_bytes:
            continue
        weight, by_rows = found
        columns = weight.shape[0 if by_rows else 1]
        blocks = min(-(-weight.nbytes // limit_bytes), columns // MIN_BLOCK_COLUMNS)
        if blocks >= 2:
            out[_name(node)] = int(blocks)
    return out


def split_products(model: LoadedModel, blocks: Mapping[str, int]) -> None:
    """Rewrites ``model`` in place: each product named in ``blocks`` (as :func:`wide_products`
    gives them) becomes that many products over column blocks and a ``Concat``. The same
    ``blocks`` on the same loaded model gives the same nodes, in the same order."""
    if not blocks:
        return
    if model.column_splits:
        raise ValueError("the model's products are divided already")
    nodes: list[Node] = []
    for node in model.nodes:
        k = blocks.get(_name(node), 1)
        found = _weight(model, node) if k > 1 else None
        if found is None:
            if k > 1:
                raise ValueError(f"{_name(node)}: not a product with a constant 2-D weight; cannot split it")
            nodes.append(node)
            continue
        nodes.extend(_split(model, node, found[0], found[1], k))
    model.nodes[:] = nodes
    model.column_splits = dict(blocks)
    model.drop_unread_constants()


def blocks_named(model: LoadedModel, op_names: Iterable[str]) -> dict[str, int]:
    """The division that ``op_names`` (a plan's ops, made on a divided copy of ``model``) shows:
    node name → blocks, for each ``NAME/cols<i>`` whose ``NAME`` is a product of ``model``."""
    nodes = {_name(n) for n in model.nodes}
    blocks: dict[str, int] = {}
    for op in op_names:
        name, sep, index = op.rpartition("/cols")
        if sep and index.isdigit() and name in nodes:
            blocks[name] = max(blocks.get(name, 0), int(index) + 1)
    return blocks


def split_for_budgets(model: LoadedModel, budgets: Sequence[int]) -> dict[str, int]:
    """Divides, once, the products of a model about to be planned over members with these
    budgets (bytes) whose weight exceeds half the largest; returns what was divided."""
    if len(budgets) > 1 and not model.column_splits:
        split_products(model, wide_products(model, max(budgets) // 2))
    return model.column_splits


def _name(node: Node) -> str:
    return node.name or node.outputs[0]


def _split(model: LoadedModel, node: Node, weight: np.ndarray, by_rows: bool, k: int) -> list[Node]:
    out_name = node.outputs[0]
    out = model.tensors[out_name]
    columns = weight.shape[0 if by_rows else 1]
    edges = [columns * i // k for i in range(k + 1)]  # k blocks as even as the columns allow
    bias = model.constants.get(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    name = _name(node)
    parts: list[Node] = []
    for i, (a, b) in enumerate(zip(edges, edges[1:])):
        block = f"{name}/cols{i}"
        w_name = model.fresh_name(f"{node.inputs[1]}/cols{i}")
        piece = weight[a:b] if by_rows else weight[:, a:b]
        model.constants[w_name] = piece
        model.tensors[w_name] = TensorInfo(piece.shape, piece.dtype)
        inputs = [node.inputs[0], w_name, *node.inputs[2:]]
        if bias is not None and bias.shape[-1:] == (columns,) and columns > 1:
            b_name = model.fresh_name(f"{node.inputs[2]}/cols{i}")
            model.constants[b_name] = bias[..., a:b]
            model.tensors[b_name] = TensorInfo(bias[..., a:b].shape, bias.dtype)
            inputs[2] = b_name
        y_name = model.fresh_name(f"{out_name}/cols{i}")
        model.tensors[y_name] = TensorInfo((*out.shape[:-1], b - a), out.dtype)
        parts.append(Node(block, node.op_type, node.domain, inputs, [y_name], dict(node.attrs)))
    join = Node(f"{name}/join", "Concat", "", [p.outputs[0] for p in parts], [out_name],
                {"axis": len(out.shape) - 1})
    return [*parts, join]


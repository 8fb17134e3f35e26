"""Load-time rewrites that fold a bias and an activation into the product before them.

Each dispatch of a recorded model costs a few microseconds of GPU time of its own (the barrier
before it and the launch), so on small models the number of dispatches is the latency. Three
rewrites, applied in node order until nothing changes, remove the commonest extra dispatches:

- ``Conv(X, W[, B])`` then ``Add(·, b)`` with a constant per-channel ``b`` (shape [C], [C,1,1]
  or [1,C,1,1], …) becomes ``Conv(X, W, B + b)``: a framework's ``Conv2d`` bias as exporters
  spell it;
- ``MatMul(A, W)`` with a 2-D ``A`` and a constant 2-D ``W``, then ``Add(·, b)`` with a
  constant ``b`` of shape [N] or [1, N], becomes ``Gemm(A, W, b)``;
- ``Conv`` or ``Gemm`` then ``Relu`` becomes the product with ``activation = "Relu"``, an
  attribute of vkpool's own that the kernels apply in their epilogue.

A rewrite applies only when the intermediate tensor has that one reader and is not a graph
output, so every tensor a caller can see keeps its value. Results equal the unfused graph's up
to float rounding of the bias sum (exact when the product had no bias of its own).
The element-wise chains of the ``add_chain`` benchmark are never touched.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from vkpool.kernels.base import TensorInfo

if TYPE_CHECKING:
    from vkpool.model import LoadedModel, Node


def fuse(model: LoadedModel) -> int:
    """Rewrites ``model`` in place; returns the number of nodes removed."""
    before = len(model.nodes)
    while _fuse_once(model):
        pass
    if len(model.nodes) < before:  # biases folded into new constants leave their old ones unread
        model.drop_unread_constants()
    return before - len(model.nodes)


def _fuse_once(model: LoadedModel) -> bool:
    readers: Counter[str] = Counter(name for node in model.nodes for name in node.inputs if name)
    graph_outputs = {name for name, _ in model.outputs}
    producer = {out: node for node in model.nodes for out in node.outputs if out}
    for node in model.nodes:
        if node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        first = node.inputs[0]
        prev = producer.get(first)
        if prev is None or readers[first] != 1 or first in graph_outputs:
            continue
        if node.op_type == "Add" and prev.op_type == "Conv" and "activation" not in prev.attrs:
            if _fold_conv_bias(model, prev, node):
                _splice(model, prev, node)
                return True
        elif node.op_type == "Add" and prev.op_type == "MatMul":
            if _matmul_to_gemm(model, prev, node):
                _splice(model, prev, node)
                return True
        elif node.op_type == "Relu" and prev.op_type in ("Conv", "Gemm") and "activation" not in prev.attrs:
            prev.attrs["activation"] = "Relu"
            _splice(model, prev, node)
            return True
    return False


def _splice(model: LoadedModel, kept: Node, removed: Node) -> None:
    """``kept`` takes over ``removed``'s output; ``removed`` leaves the graph."""
    model.tensors.pop(kept.outputs[0], None)
    kept.outputs[0] = removed.outputs[0]
    model.nodes.remove(removed)


def _other_constant(model: LoadedModel, add: Node, first: str) -> np.ndarray | None:
    if len(add.inputs) != 2 or add.inputs[0] != first:
        return None
    value = model.constants.get(add.inputs[1])
    return value if value is not None and value.dtype == np.float32 else None


def _fold_conv_bias(model: LoadedModel, conv: Node, add: Node) -> bool:
    bias = _other_constant(model, add, conv.outputs[0])
    out = model.tensors.get(conv.outputs[0])
    if bias is None or out is None or len(out.shape) < 3:
        return False
    channels = out.shape[1]
    rank = len(out.shape)
    shape = tuple(bias.shape)
    # per-channel is [C, 1, ...] or [1, C, 1, ...]; a bare [C] would broadcast along the last axis
    if len(shape) > rank or int(np.prod(shape)) != channels or len(shape) < rank - 1:
        return False
    if shape[len(shape) - (rank - 1)] != channels:
        return False
    total = bias.reshape(channels).astype(np.float32)
    if len(conv.inputs) > 2 and conv.inputs[2]:
        own = model.constants.get(conv.inputs[2])
        if own is None:
            return False
        total = (own.astype(np.float32) + total).astype(np.float32)
    name = model.fresh_name(f"{conv.name or conv.outputs[0]}_fused_bias")
    model.constants[name] = total
    model.tensors[name] = TensorInfo((channels,), np.dtype(np.float32))
    conv.inputs[2:] = [name]
    return True


def _matmul_to_gemm(model: LoadedModel, matmul: Node, add: Node) -> bool:
    bias = _other_constant(model, add, matmul.outputs[0])
    a = model.tensors.get(matmul.inputs[0])
    weight = model.constants.get(matmul.inputs[1])
    if bias is None or a is None or weight is None or len(a.shape) != 2 or weight.ndim != 2:
        return False
    if a.dtype != np.float32 or weight.dtype != np.float32:
        return False
    n = weight.shape[1]
    if tuple(bias.shape) not in ((n,), (1, n)):
        return False
    matmul.op_type = "Gemm"
    matmul.inputs = [matmul.inputs[0], matmul.inputs[1], add.inputs[1]]
    matmul.attrs = {}
    return True


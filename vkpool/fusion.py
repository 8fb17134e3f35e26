"""Load-time rewrites that fold the ops around products into fewer dispatches.

Each dispatch of a recorded model costs a few microseconds of GPU time of its own (the barrier
before it and the launch), so on small models and transformer blocks the number of dispatches is
the latency. The rewrites, applied in node order until nothing changes:

- ``Conv(X, W[, B])`` then ``Add(·, b)`` with a constant per-channel ``b`` (shape [C], [C,1,1]
  or [1,C,1,1], …) becomes ``Conv(X, W, B + b)``: a framework's ``Conv2d`` bias as exporters
  spell it;
- ``MatMul(A, W)`` with a constant 2-D float32 ``W`` (A of any rank), then ``Add`` of a
  constant ``b`` that broadcasts along the last axis only ([N], [1, N], [1, 1, N], in either
  operand order), becomes ``MatMul(A, W, b)``: a bias input of vkpool's own that the product
  adds in its epilogue (a ``Linear`` layer as exporters spell it);
- a ``Conv``, ``Gemm`` or such ``MatMul`` then an activation (directly, or through a ``Reshape``
  of the product's rows) becomes the product with the attribute ``activation`` (vkpool's own,
  applied in the epilogue, ``kernels/shaders/epilogue.glsl``): a ``Relu`` or ``Gelu`` node, or a chain of element-wise ops with scalar
  constants that computes GELU (exact or tanh approximation) however the exporter spelled it
  (``x * 0.5 * (1 + Erf(x / sqrt 2))``, ``0.5 * x * (1 + Tanh(c * (x + 0.044715 * x * x * x)))``,
  with Pow or Mul, constants on either side). Such a chain is recognised by evaluating it on the
  host over a dense probe of inputs (-12 to 12 and large magnitudes) and comparing with each
  activation's formula: a chain that agrees everywhere within 1e-6 (relative to 1 + |x|) is that
  activation, whatever its ops; any other chain stays as it is;
- ``Relu(Add(a, b))`` of two computed float tensors (a residual block's sum, as in ResNet) becomes
  the ``Add`` with the attribute ``activation`` = ``Relu`` (``kernels/shaders/binary.comp``'s
  ``RELU``): one pass over the sum instead of two. An ``Add`` of a constant is a bias, which the
  rewrites above take;
- such an ``Add`` (with or without that ``Relu``) of a float32 ``Conv`` without an activation,
  whose output nothing else reads, and a computed tensor ``r`` of the same shape becomes the
  ``Conv`` with ``r`` as its input 3 (vkpool's own): the convolution adds it to its outputs after
  the bias, applies the activation, and writes the block's output itself;
- ``LayerNormalization(Add(a, b))`` of two tensors of one shape becomes the norm of ``a`` with the
  residual ``b`` added as it is read (vkpool's attribute ``residual``, input 3); where the sum is
  read elsewhere too (a pre-norm block's residual stream) the norm also writes it, as its
  output 3. In float16 graphs, where ``a`` or ``b`` is a product by constant weights (with a
  bias, no activation) that nothing else reads, the norm computes that product itself (vkpool's
  attribute ``product``): a product split over K leaves its partial sums for the norm to add as
  it reads them, one pass fewer per block (a transformer's attention output and FFN-down
  projections). A norm of ``x + c1 + c2 + ...`` with constants ``c1``, ``c2``, ... (Adds in a
  chain, ``x`` of the norm input's shape) takes the constants' sum as its residual (summed in
  float64, broadcast to that shape, rounded once): a transformer's embeddings, word + position +
  token type with the last two constant, become a Gather and a norm;
- scaled dot-product attention as exporters spell it, ``Softmax(MatMul(Q, Kᵀ) / c [+ mask]) @ V``
  with the heads split by ``Reshape`` + ``Transpose`` and merged back the same way, becomes one
  ``Attention`` node (``kernels/ops/attention.py``) on the [batch, sequence, heads·size] tensors
  the projections produced, so neither the transposed heads nor the score matrix pass through
  memory as tensors of their own. The scale is ``1/c`` (or the ``Mul``'s factor); a mask is an
  ``Add`` of a float tensor, or a ``Where(cond, very negative, scores)`` of a constant
  condition, which is given as a causal flag when it is exactly the causal pattern.

float16 graphs take the same rewrites (products, biases, activations, norms and attention all in
float16, with float32 sums inside the kernels), after two rewrites of the Casts that exporters
and converters put around ops for precision:

- a ``Cast`` to the type its input already has is dropped (Hugging Face's GPT-2 casts its
  attention probabilities to the values' type);
- an op whose float16 kernel widens its inputs, computes in float32 and rounds its output once
  (``Softmax``, ``LogSoftmax``, ``LayerNormalization``, ``RMSNormalization``), with every input
  a ``Cast`` of a float16 tensor to float32 (or a float32 constant that float16 holds exactly)
  and its output read only by one ``Cast`` back to float16, becomes that op on the float16
  tensors: the same computation (float32 inside, one rounding to float16) without the two passes
  over memory (a mixed-precision converter's ``keep in float32`` list).

In float16 graphs, an ``Attention`` node whose Q, K and V are three products of one tensor by
constant weights (with or without constant biases) reads them from one product instead, of the
three weight matrices side by side (vkpool's attribute ``packed_qkv``): one dispatch for three,
and a wider product that fills the device better, which the attention then computes itself
(vkpool's attribute ``product``: a product split over K leaves its partial sums for the attention
to add as it reads Q, K and V, with no pass of their own); one whose Q, K and V are a ``Split`` of such a
product along its last axis (Hugging Face's GPT-2) reads the product itself, without the copies. Float32 graphs keep their three products (and
the numbers their tile choices give).

A rewrite applies only when every intermediate tensor it removes is read by nothing else and is
not a graph output, so every tensor a caller can see keeps its value. Results equal the unfused
graph's up to float rounding (the bias sum, ``1/c`` for a scale that is not a power of two, the
activation's formula against the exporter's rounded constants).
A spelled-out activation of a float16 product (its constants float16 roundings) is matched
within 2^-13 (relative to 1 + |x|) and takes the closest formula. The element-wise chains of
the ``add_chain`` benchmark are never touched.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Callable

import numpy as np

from vkpool.kernels.base import OpError, TensorInfo, UnsupportedOp
from vkpool.kernels.ops.gemm import ACTIVATIONS, apply_activation
from vkpool.kernels.ops.unary import erf64

if TYPE_CHECKING:
    from vkpool.model import LoadedModel, Node

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)
_FLOATS = (_F32, _F16)
#: ops whose float16 kernels widen every input, compute in float32 and round each output once
_WIDE_IN_HALF = frozenset({"Softmax", "LogSoftmax", "LayerNormalization", "RMSNormalization"})


def fuse(model: LoadedModel) -> int:
    """Rewrites ``model`` in place; returns the number of nodes removed."""
    before = len(model.nodes)
    while _fuse_once(model):
        pass
    if len(model.nodes) < before:  # biases folded into new constants leave their old ones unread
        model.drop_unread_constants()
    return before - len(model.nodes)


class _Graph:
    """Who reads and who produces each tensor of ``model``, as the nodes stand now."""

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self.readers: dict[str, list[Node]] = defaultdict(list)
        for node in model.nodes:
            for name in dict.fromkeys(n for n in node.inputs if n):
                self.readers[name].append(node)
        self.producer = {out: node for node in model.nodes for out in node.outputs if out}
        self.outputs = {name for name, _ in model.outputs}

    def private(self, tensor: str, reader: Node | None = None) -> bool:
        """Whether ``tensor`` is read only by ``reader`` (or by one node) and is not a graph output."""
        readers = self.readers.get(tensor, [])
        return tensor not in self.outputs and len(readers) == 1 and (reader is None or readers[0] is reader)

    def made_by(self, tensor: str, op_type: str) -> Node | None:
        node = self.producer.get(tensor)
        return node if node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx") else None

    def constant(self, name: str) -> np.ndarray | None:
        return self.model.constants.get(name)


def _fuse_once(model: LoadedModel) -> bool:
    g = _Graph(model)
    for node in model.nodes:
        if node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        if node.op_type == "Add":
            for first in dict.fromkeys(node.inputs):
                prev = g.producer.get(first)
                if prev is None or not g.private(first) or "activation" in prev.attrs:
                    continue
                if prev.op_type == "Conv" and _fold_conv_bias(model, prev, node, first):
                    _splice(model, prev, node)
                    return True
                if prev.op_type == "MatMul" and _fold_matmul_bias(model, g, prev, node, first):
                    _splice(model, prev, node)
                    return True
        if node.op_type in ("Conv", "Gemm", "MatMul") and "activation" not in node.attrs and _fuse_activation(g, node):
            return True
        if node.op_type == "Add" and "activation" not in node.attrs and _fuse_residual_relu(g, node):
            return True
        if node.op_type == "Add" and _fold_residual_into_conv(g, node):
            return True
        if node.op_type == "Softmax" and _fuse_attention(g, node):
            return True
        if node.op_type == "LayerNormalization" and "residual" not in node.attrs and _fuse_residual(g, node):
            return True
        if node.op_type == "LayerNormalization" and node.attrs.get("residual") and "product" not in node.attrs \
                and _fold_product_into_norm(g, node):
            return True
        if node.op_type == "Cast" and _drop_same_type_cast(g, node):
            return True
        if node.op_type == "Attention" and node.domain == "" and "packed_qkv" not in node.attrs \
                and _pack_qkv(g, node):
            return True
        if node.op_type == "Attention" and node.domain == "" and "packed_qkv" in node.attrs \
                and "product" not in node.attrs and _fold_product_into_attention(g, node):
            return True
        if node.op_type in _WIDE_IN_HALF and _drop_precision_casts(g, node):
            return True
    return False


# -- Casts ------------------------------------------------------------------------------------

def _cast_to(node: Node) -> np.dtype | None:
    from onnx import helper

    to = node.attrs.get("to")
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(int(to))) if to is not None else None
    except (KeyError, TypeError, ValueError):
        return None


def _drop_same_type_cast(g: _Graph, cast: Node) -> bool:
    x, y = cast.inputs[0], cast.outputs[0]
    info = g.model.tensors.get(x)
    if info is None or y in g.outputs or len(cast.inputs) != 1 or _cast_to(cast) != info.dtype:
        return False
    for reader in g.readers.get(y, []):
        reader.inputs = [x if name == y else name for name in reader.inputs]
    g.model.tensors.pop(y, None)
    g.model.nodes.remove(cast)
    return True


def _drop_precision_casts(g: _Graph, node: Node) -> bool:
    """``Cast(float16 → float32)`` into ``node`` and ``Cast(→ float16)`` out of it: ``node`` in float16."""
    model = g.model
    out = node.outputs[0]
    if model.tensors.get(out) is None or model.tensors[out].dtype != _F32 or not g.private(out):
        return False
    down = g.readers[out][0]
    if down.op_type != "Cast" or down.domain not in ("", "ai.onnx") or _cast_to(down) != _F16:
        return False
    if any(name for name in node.outputs[1:]):
        return False  # LayerNormalization's statistics stay float32
    sources: list[str] = []
    for name in node.inputs:
        info = model.tensors.get(name) if name else None
        if info is None or info.dtype != _F32:
            sources.append(name)  # absent, or not a float (an axes input)
            continue
        value = g.constant(name)
        if value is not None:
            if not np.array_equal(value.astype(_F16).astype(_F32), value):
                return False
            sources.append("")  # a float16 copy is made below, once the rewrite is sure
            continue
        up = g.made_by(name, "Cast")
        if up is None or g.model.tensors.get(up.inputs[0]) is None or model.tensors[up.inputs[0]].dtype != _F16:
            return False
        sources.append(up.inputs[0])
    for i, name in enumerate(node.inputs):
        if name and sources[i] == "":
            half = model.fresh_name(f"{name}_f16")
            model.constants[half] = model.constants[name].astype(_F16)
            model.tensors[half] = TensorInfo(model.constants[half].shape, _F16)
            sources[i] = half
    for name in set(node.inputs) - set(sources):
        up = g.producer.get(name)
        if up is not None and up.op_type == "Cast" and g.private(name, node):
            model.tensors.pop(name, None)
            model.nodes.remove(up)
    node.inputs = sources
    _splice(model, node, down)
    return True


def _fuse_residual(g: _Graph, norm: Node) -> bool:
    """``LayerNormalization(Add(a, b), ...)`` with a and b of the normalised tensor's shape becomes
    the norm of ``a`` with residual ``b``; a sum read elsewhere becomes the norm's fourth output."""
    x = norm.inputs[0]
    add = g.made_by(x, "Add")
    info = g.model.tensors.get(x)
    if add is None or info is None or info.dtype not in _FLOATS or len(add.inputs) != 2 or len(norm.inputs) > 3:
        return False
    a, b = add.inputs
    removed, residual = [add], None
    if a in g.model.constants or b in g.model.constants:
        terms = _constant_terms(g, add, info)
        if terms is None:
            return False
        a, residual, removed = terms
    elif any(g.model.tensors.get(t) != info for t in (a, b)):
        return False
    others = [r for r in g.readers.get(x, []) if r is not norm]
    order = {id(n): i for i, n in enumerate(g.model.nodes)}
    if any(order[id(r)] < order[id(norm)] for r in others):
        return False  # a reader of the sum before the norm would lose its producer
    if residual is not None:  # the constants' sum becomes a constant of the model's
        b = g.model.fresh_name(f"{add.name or add.outputs[0]}_constant_residual")
        g.model.constants[b] = residual
        g.model.tensors[b] = info
    norm.inputs = [a, *norm.inputs[1:3], *([""] * (3 - len(norm.inputs))), b]
    norm.attrs["residual"] = 1
    if others or x in g.outputs:
        norm.outputs = [*norm.outputs, *([""] * (3 - len(norm.outputs))), x]
    else:
        g.model.tensors.pop(x, None)
    for node in removed:
        if node is not add:
            g.model.tensors.pop(node.outputs[0], None)
        g.model.nodes.remove(node)
    return True


#: the most bytes of a residual made of constants (their sum, broadcast to the norm's input)
_CONSTANT_RESIDUAL_BYTES = 64 << 20


def _constant_terms(g: _Graph, add: Node, info: TensorInfo) -> tuple[str, np.ndarray, list[Node]] | None:
    """A norm's input ``add`` = ``x + c1 + c2 + ...``, Adds each of one computed tensor and one
    constant (the inner sums read by nothing else), with ``x`` of the norm input's shape: ``x``,
    the constants' sum (taken in float64, broadcast to that shape, rounded once to its type) and
    the Adds it replaces. A transformer's embeddings, word +
    position + token type with the last two constant, so become the norm's residual."""
    model = g.model
    total: np.ndarray | None = None
    chain: list[Node] = []
    node: Node | None = add
    x = ""
    while node is not None:
        if len(node.inputs) != 2 or "activation" in node.attrs:
            break
        p, q = node.inputs
        if (p in model.constants) == (q in model.constants):
            break
        x, c = (q, p) if p in model.constants else (p, q)
        value = model.constants[c]
        if value.dtype != info.dtype:
            break
        total = value.astype(np.float64) if total is None else total + value.astype(np.float64)
        chain.append(node)
        inner = g.made_by(x, "Add")
        node = inner if inner is not None and g.private(x, node) else None
    if total is None or model.tensors.get(x) != info or info.nbytes > _CONSTANT_RESIDUAL_BYTES:
        return None
    try:
        return x, np.ascontiguousarray(np.broadcast_to(total, info.shape).astype(info.dtype)), chain
    except ValueError:
        return None


#: where a node that computes its product (vkpool's attribute ``product``) takes the product's
#: constant weights, then its bias; input 0 is the product's A
PRODUCT_AT = {"LayerNormalization": 4, "Attention": 7}


def _absorb_product(g: _Graph, node: Node, x: str, inputs: list[str]) -> bool:
    """``node`` computes the float16 product ``x`` itself (vkpool's attribute ``product``) where
    ``x`` is a product of constant 2-D weights, with or without a bias and no activation, read by
    nothing else: A becomes input 0, the weights and bias go to ``PRODUCT_AT``, ``inputs`` giving
    the node's other inputs (positions 1 on). The op is built first, so a node its kernels cannot
    take stays as it is."""
    model = g.model
    product = g.made_by(x, "MatMul")
    info = model.tensors.get(x)
    if product is None or "activation" in product.attrs or not g.private(x, node) or info is None \
            or info.dtype != _F16 or product.inputs[1] not in model.constants \
            or model.constants[product.inputs[1]].ndim != 2:
        return False
    a, w, c = (list(product.inputs) + ["", ""])[:3]
    at = PRODUCT_AT[node.op_type]
    new = [a, *(inputs + [""] * at)[:at - 1], w, c]
    attrs = {**node.attrs, "product": 1}
    from vkpool.kernels.registry import create_op  # the registry imports every op module

    try:
        op = create_op(node.op_type, attrs, [model.tensors.get(t) if t else None for t in new],
                       {at: model.constants[w]}, opset=model.opset, num_outputs=len(node.outputs))
        if op.output_infos()[0] != model.tensors[node.outputs[0]]:
            return False
    except (OpError, UnsupportedOp):
        return False
    node.inputs, node.attrs = new if c else new[:-1], attrs
    model.tensors.pop(x, None)
    model.nodes.remove(product)
    return True


def _fold_product_into_norm(g: _Graph, norm: Node) -> bool:
    """A float16 residual ``LayerNormalization`` whose X (or residual: the sum is the same) is a
    product of constant weights computes that product itself (inputs A, scale, bias, residual, W,
    product bias): a split product's partial sums are then added where the norm reads them, not
    in a pass of their own (``kernels/ops/norms.py``)."""
    if len(norm.inputs) != 4:
        return False
    return any(_absorb_product(g, norm, norm.inputs[pos], [*norm.inputs[1:3], norm.inputs[3 - pos]])
               for pos in (0, 3))


def _splice(model: LoadedModel, kept: Node, removed: Node) -> None:
    """``kept`` takes over ``removed``'s output; ``removed`` leaves the graph."""
    model.tensors.pop(kept.outputs[0], None)
    kept.outputs[0] = removed.outputs[0]
    model.nodes.remove(removed)


def _other_constant(model: LoadedModel, add: Node, first: str, dtype: np.dtype = _F32) -> np.ndarray | None:
    """The constant of type ``dtype`` that ``add`` adds to ``first``."""
    if len(add.inputs) != 2 or add.inputs[0] == add.inputs[1]:
        return None
    other = add.inputs[1] if add.inputs[0] == first else add.inputs[0]
    value = model.constants.get(other)
    return value if value is not None and value.dtype == dtype else None


def _fold_conv_bias(model: LoadedModel, conv: Node, add: Node, first: str) -> bool:
    bias = _other_constant(model, add, first)
    out = model.tensors.get(conv.outputs[0])
    if bias is None or out is None or len(out.shape) < 3 or model.tensors.get(add.outputs[0]) != out:
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
    model.tensors[name] = TensorInfo((channels,), _F32)
    _set_input(conv, 2, name)  # a residual (input 3) stays
    return True


def _set_input(node: Node, pos: int, name: str) -> None:
    """``node``'s input ``pos`` becomes ``name``, absent ones ("") filling the places before it."""
    node.inputs = [*node.inputs, *[""] * (pos + 1 - len(node.inputs))]
    node.inputs[pos] = name


def _fold_matmul_bias(model: LoadedModel, g: _Graph, matmul: Node, add: Node, first: str) -> bool:
    a = model.tensors.get(matmul.inputs[0])
    weight = g.constant(matmul.inputs[1])
    out = model.tensors.get(matmul.outputs[0])
    if a is None or weight is None or out is None or len(matmul.inputs) != 2:
        return False
    bias = _other_constant(model, add, first, a.dtype)
    if bias is None or a.dtype not in _FLOATS or weight.dtype != a.dtype or weight.ndim != 2 \
            or model.tensors.get(add.outputs[0]) != out:
        return False
    n = weight.shape[1]
    if bias.ndim > len(out.shape) or bias.shape[-1:] != (n,) or any(d != 1 for d in bias.shape[:-1]):
        return False
    name = add.inputs[1] if add.inputs[0] == first else add.inputs[0]
    if bias.shape != (n,):
        name = model.fresh_name(f"{matmul.name or matmul.outputs[0]}_bias")
        model.constants[name] = bias.reshape(n)
        model.tensors[name] = TensorInfo((n,), bias.dtype)
    matmul.inputs = [matmul.inputs[0], matmul.inputs[1], name]
    return True


# -- activations ------------------------------------------------------------------------------

#: element-wise ops a spelled-out activation may use, as float64 numpy functions
_SMOOTH: dict[str, Callable[..., np.ndarray]] = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide, "Pow": np.power,
    "Erf": erf64, "Tanh": np.tanh, "Sqrt": np.sqrt, "Neg": np.negative, "Reciprocal": np.reciprocal,
}
#: the most nodes a spelled-out activation may take (GELU's tanh form takes 8 or 9)
_MAX_CHAIN = 12
_PROBE = np.concatenate([np.linspace(-12.0, 12.0, 4801), [-1e3, -100.0, -50.0, -20.0, 20.0, 50.0, 100.0, 1e3]])


def _fuse_residual_relu(g: _Graph, add: Node) -> bool:
    """``Relu(Add(a, b))`` of two computed float tensors (a residual block's sum, as in ResNet)
    becomes the ``Add`` with the attribute ``activation`` = ``Relu``. An ``Add`` of a constant is
    left to the bias rewrites above (a product's bias, then its activation)."""
    y = add.outputs[0]
    if len(add.inputs) != 2 or any(g.constant(name) is not None for name in add.inputs) or not g.private(y):
        return False
    info = g.model.tensors.get(y)
    relu = g.readers[y][0]
    if info is None or np.dtype(info.dtype).kind != "f" or relu.op_type != "Relu" or relu.domain not in ("", "ai.onnx"):
        return False
    add.attrs["activation"] = "Relu"
    _splice(g.model, add, relu)
    return True


def _fold_residual_into_conv(g: _Graph, add: Node) -> bool:
    """``Add(Conv(...), r)`` (with the ``Relu`` the rule above may have given it) of a convolution
    without an activation whose output only the ``Add`` reads, and ``r`` a computed tensor of the
    same shape and type: the convolution adds ``r`` to its outputs before its activation (its
    input 3, ``kernels/ops/conv.py``) and takes the ``Add``'s activation and output. It moves to
    the ``Add``'s place, after ``r`` is made: one dispatch and one pass over the sum fewer."""
    if len(add.inputs) != 2 or add.inputs[0] == add.inputs[1] or set(add.attrs) - {"activation"}:
        return False
    y = add.outputs[0]
    info = g.model.tensors.get(y)
    if info is None or info.dtype != _F32:
        return False
    for first in add.inputs:
        conv = g.made_by(first, "Conv")
        other = add.inputs[1] if add.inputs[0] == first else add.inputs[0]
        if conv is None or not g.private(first, add) or "activation" in conv.attrs or len(conv.inputs) > 3 \
                or g.model.tensors.get(first) != info or g.model.tensors.get(other) != info \
                or g.constant(other) is not None:
            continue
        _set_input(conv, 3, other)
        if "activation" in add.attrs:
            conv.attrs["activation"] = add.attrs["activation"]
        nodes = g.model.nodes
        nodes.remove(conv)
        nodes[nodes.index(add)] = conv
        g.model.tensors.pop(first, None)
        conv.outputs[0] = y
        return True
    return False


def _fusable_product(g: _Graph, node: Node) -> bool:
    if node.op_type == "MatMul":
        b = g.model.tensors.get(node.inputs[1]) if len(node.inputs) > 1 else None
        a = g.model.tensors.get(node.inputs[0])
        return a is not None and b is not None and a.dtype in _FLOATS and b.dtype == a.dtype and len(b.shape) == 2
    return node.op_type in ("Conv", "Gemm")


def _fuse_activation(g: _Graph, product: Node) -> bool:
    x = product.outputs[0]
    if not x or x in g.outputs or not _fusable_product(g, product):
        return False
    readers = g.readers.get(x, [])
    # a product on flattened rows reshaped back (Hugging Face's Conv1D as a Gemm): the activation
    # of the reshaped tensor is the reshape of the activated product
    via = readers[0] if len(readers) == 1 and readers[0].op_type == "Reshape" and readers[0].domain in ("", "ai.onnx") \
        else None
    start = via.outputs[0] if via is not None else x
    if start in g.outputs:
        return False
    last = via or product  # the node whose output the activation's output becomes
    readers = g.readers.get(start, [])
    if len(readers) == 1 and readers[0].op_type in ("Relu", "Gelu") and readers[0].domain in ("", "ai.onnx"):
        act = readers[0]
        if act.op_type == "Relu":
            product.attrs["activation"] = "Relu"
        else:
            approximate = act.attrs.get("approximate", "none")
            approximate = approximate.decode() if isinstance(approximate, bytes) else str(approximate)
            if approximate not in ("none", "tanh"):
                return False
            product.attrs["activation"] = "Gelu" if approximate == "none" else "GeluTanh"
        _splice(g.model, last, act)
        return True
    chain = _elementwise_chain(g, start)
    if chain is None:
        return False
    nodes, exit_name = chain
    values = _evaluate_chain(g, nodes, start, exit_name)
    if values is None:
        return False
    # float16: the chain's constants are float16 roundings (sqrt 2 as 1.4140625), so it differs
    # from its formula by up to ~1.4e-5 (relative to 1 + |x|); 2^-13 stays below the 1.3e-4
    # between the erf and tanh forms, and far below a float16 ulp of the result
    tolerance = 1e-6 if g.model.tensors[x].dtype == _F32 else 2.0 ** -13
    scale = 1.0 + np.abs(_PROBE)
    errors = {name: float(np.max(np.abs(values - apply_activation(code, _PROBE)) / scale))
              for name, code in ACTIVATIONS.items() if code != 1}  # a Relu spelled out is not smooth
    best = min(errors, key=errors.__getitem__)
    if errors[best] > tolerance:
        return False
    product.attrs["activation"] = best
    info = g.model.tensors[exit_name]
    for node in nodes:
        g.model.tensors.pop(node.outputs[0], None)
        g.model.nodes.remove(node)
    g.model.tensors.pop(start, None)
    g.model.tensors[exit_name] = info
    last.outputs[0] = exit_name
    return True


def _scalar(g: _Graph, name: str) -> bool:
    value = g.constant(name)
    return value is not None and value.size == 1 and value.dtype in _FLOATS


def _elementwise_chain(g: _Graph, x: str) -> tuple[list[Node], str] | None:
    """The element-wise nodes computing a function of ``x`` alone (with scalar constants), and the
    one tensor of theirs read elsewhere; None where there is no such chain."""
    produced = {x}
    chain: list[Node] = []
    grew = True
    while grew:
        grew = False
        for name in list(produced):
            for node in g.readers.get(name, []):
                if any(node is c for c in chain) or node.op_type not in _SMOOTH or node.domain not in ("", "ai.onnx"):
                    continue
                if len(node.outputs) != 1 or not all(i in produced or _scalar(g, i) for i in node.inputs):
                    continue
                chain.append(node)
                produced.add(node.outputs[0])
                grew = True
                if len(chain) > _MAX_CHAIN:
                    return None
    if not chain:
        return None
    members = {id(n) for n in chain}
    outside = [t for t in produced
               if t in g.outputs or any(id(r) not in members for r in g.readers.get(t, []))]
    if len(outside) != 1 or outside[0] == x:
        return None
    info = g.model.tensors.get(x)
    if info is None or g.model.tensors.get(outside[0]) != info:
        return None
    order = {id(n): i for i, n in enumerate(g.model.nodes)}
    chain.sort(key=lambda n: order[id(n)])
    return chain, outside[0]


def _evaluate_chain(g: _Graph, chain: list[Node], x: str, exit_name: str) -> np.ndarray | None:
    values: dict[str, np.ndarray] = {x: _PROBE}
    with np.errstate(all="ignore"):
        for node in chain:
            args = [values[i] if i in values else g.constant(i).astype(np.float64).reshape(()) for i in node.inputs]
            values[node.outputs[0]] = np.asarray(_SMOOTH[node.op_type](*args), dtype=np.float64)
    out = values[exit_name]
    return out if out.shape == _PROBE.shape else None


# -- attention --------------------------------------------------------------------------------

def _heads(g: _Graph, t4: str, perm: list[int]) -> tuple[str, int] | None:
    """``(t3, heads)`` where ``t4 = Transpose(Reshape(t3, [B, S, H, D]), perm)`` with t3 of shape
    [B, S, H·D] and every intermediate read only on this path."""
    tr = g.made_by(t4, "Transpose")
    if tr is None or [int(p) for p in tr.attrs.get("perm", [])] != perm or not g.private(t4):
        return None
    reshaped = tr.inputs[0]
    rs = g.made_by(reshaped, "Reshape")
    if rs is None or not g.private(reshaped):
        return None
    t3 = rs.inputs[0]
    src, mid = g.model.tensors.get(t3), g.model.tensors.get(reshaped)
    if src is None or mid is None or len(src.shape) != 3 or len(mid.shape) != 4 or src.dtype not in _FLOATS:
        return None
    b, s, h, d = mid.shape
    if src.shape != (b, s, h * d):
        return None
    return t3, h


def _key_heads(g: _Graph, kt: str) -> tuple[str, int] | None:
    """K's [B, T, H·D] tensor where ``kt`` is its heads transposed to [B, H, D, T]."""
    direct = _heads(g, kt, [0, 2, 3, 1])
    if direct is not None:
        return direct
    tr = g.made_by(kt, "Transpose")
    if tr is None or [int(p) for p in tr.attrs.get("perm", [])] != [0, 1, 3, 2] or not g.private(kt):
        return None
    return _heads(g, tr.inputs[0], [0, 2, 1, 3])


def _masks(g: _Graph, z: str, shape: tuple[int, ...], dtype: np.dtype) -> list[tuple[str, dict, list[Node]]]:
    """The ways ``z`` (the softmax's input, of type ``dtype``) may be scores with a mask applied:
    ``(scores, extra attributes, mask nodes)``, the unmasked reading last."""
    found: list[tuple[str, dict, list[Node]]] = []
    # a fill at or below this is a masked key: exp(fill - max) is 0 (float16 scores end at -65504)
    lowest = -1e30 if dtype == _F32 else float(np.finfo(dtype).min)
    add = g.made_by(z, "Add")
    if add is not None and g.private(z) and len(add.inputs) == 2 and add.inputs[0] != add.inputs[1]:
        for scores, mask in (add.inputs, add.inputs[::-1]):
            info = g.model.tensors.get(mask)
            if info is not None and info.dtype == dtype:
                found.append((scores, {"mask": mask}, [add]))
    where = g.made_by(z, "Where")
    if where is not None and g.private(z) and len(where.inputs) == 3:
        cond = g.constant(where.inputs[0])
        for fill_at, scores_at, masked_when in ((1, 2, True), (2, 1, False)):
            fill = g.constant(where.inputs[fill_at])
            if cond is None or fill is None or cond.dtype != np.bool_ or fill.size != 1:
                continue
            if float(fill.reshape(())) > lowest or cond.ndim < 2 or cond.ndim > 4:
                continue
            keep = ~cond if masked_when else cond
            try:
                every = np.broadcast_to(keep, shape)
            except ValueError:
                continue
            if not every.any(axis=-1).all():
                continue  # a fully masked row: -inf and a finite fill differ there
            s, t = shape[-2:]
            if keep.shape[-2:] == (s, t) and every.shape == shape and all(d == 1 for d in keep.shape[:-2]) \
                    and (keep.reshape(s, t) == np.tril(np.ones((s, t), bool))).all():
                found.append((where.inputs[scores_at], {"causal": True}, [where]))
                continue
            # the mask becomes a constant only if the attention is fused (_fuse_attention_from)
            found.append((where.inputs[scores_at], {"keep": np.ascontiguousarray(keep), "of": where.inputs[0]},
                          [where]))
    found.append((z, {}, []))
    return found


def _fuse_attention(g: _Graph, softmax: Node) -> bool:
    model = g.model
    p = softmax.outputs[0]
    z = softmax.inputs[0]
    info = model.tensors.get(z)
    if info is None or len(info.shape) != 4 or info.dtype not in _FLOATS or not g.private(p):
        return False
    axis = int(softmax.attrs.get("axis", -1 if model.opset >= 13 else 1))
    if axis % 4 != 3:
        return False
    pv = g.readers[p][0]
    if pv.op_type != "MatMul" or pv.inputs[0] != p or len(pv.inputs) != 2:
        return False
    return any(_fuse_attention_from(g, softmax, pv, *masked) for masked in _masks(g, z, info.shape, info.dtype))


def _fuse_attention_from(g: _Graph, softmax: Node, pv: Node, y: str, extra: dict, mask_nodes: list[Node]) -> bool:
    model = g.model
    p = softmax.outputs[0]
    scale, scale_nodes = 1.0, []
    for op_type in ("Div", "Mul"):
        node = g.made_by(y, op_type)
        if node is not None and g.private(y) and len(node.inputs) == 2 and _scalar(g, node.inputs[1]):
            c = float(g.constant(node.inputs[1]).reshape(()))
            if c == 0.0 or not math.isfinite(c):
                return False
            scale, scale_nodes, y = (1.0 / c if op_type == "Div" else c), [node], node.inputs[0]
            break
    qk = g.made_by(y, "MatMul")
    if qk is None or not g.private(y) or len(qk.inputs) != 2:
        return False
    q = _heads(g, qk.inputs[0], [0, 2, 1, 3])
    k = _key_heads(g, qk.inputs[1])
    v = _heads(g, pv.inputs[1], [0, 2, 1, 3])
    o4 = pv.outputs[0]
    out_tr = g.readers.get(o4, [])
    if q is None or k is None or v is None or not g.private(o4) or out_tr[0].op_type != "Transpose":
        return False
    tr = out_tr[0]
    if [int(x) for x in tr.attrs.get("perm", [])] != [0, 2, 1, 3] or not g.private(tr.outputs[0]):
        return False
    merge = g.readers[tr.outputs[0]][0]
    o3 = merge.outputs[0] if merge.op_type == "Reshape" else ""
    oinfo, qinfo = model.tensors.get(o3), model.tensors.get(q[0])
    if not o3 or oinfo is None or qinfo is None or len(oinfo.shape) != 3 or oinfo.shape[:2] != qinfo.shape[:2]:
        return False
    keep = extra.get("keep")
    mask_info = TensorInfo(keep.shape, np.bool_) if keep is not None else model.tensors.get(extra.get("mask", ""))
    inputs = [q[0], k[0], v[0], extra.get("mask", "")]
    attrs = {"q_num_heads": q[1], "kv_num_heads": k[1], "scale": scale, "is_causal": int(extra.get("causal", False))}
    from vkpool.kernels.registry import create_op  # the registry imports every op module

    try:
        op = create_op("Attention", attrs, [model.tensors[i] for i in inputs[:3]] + [mask_info],
                       {}, opset=model.opset, num_outputs=1)
        if op.output_infos()[0] != oinfo:
            return False
    except (OpError, UnsupportedOp):
        return False
    if v[1] != k[1]:
        return False
    if keep is not None:
        inputs[3] = model.fresh_name(f"{extra['of']}_keep")
        model.constants[inputs[3]] = keep
        model.tensors[inputs[3]] = mask_info
    removed = [qk, *scale_nodes, *mask_nodes, softmax, pv, tr, merge]
    for t4 in (qk.inputs[0], qk.inputs[1], pv.inputs[1]):
        node = g.producer[t4]
        removed.append(node)
        inner = g.producer.get(node.inputs[0])
        if inner is not None and inner.op_type == "Transpose":  # K's heads transposed twice
            removed.append(inner)
            inner = g.producer.get(inner.inputs[0])
        if inner is not None:
            removed.append(inner)
    fused = type(softmax)(f"{softmax.name or p}_attention", "Attention", "", inputs[:3] + ([inputs[3]] if inputs[3] else []),
                          [o3], attrs)
    gone = {id(n) for n in removed}
    for node in removed:
        for out in node.outputs:
            if out != o3:
                model.tensors.pop(out, None)
    # in the merge's place: every input of the attention is computed before it
    model.nodes[:] = [fused if n is merge else n for n in model.nodes if n is merge or id(n) not in gone]
    return True


def _fold_product_into_attention(g: _Graph, attention: Node) -> bool:
    """A packed float16 ``Attention`` whose Q/K/V tensor is a product of constant weights computes
    that product itself (A in input 0, W and the bias as inputs 7 and 8): a product split over K
    leaves its partial sums for the attention to add as it reads Q, K and V
    (``kernels/ops/attention.py``)."""
    return _absorb_product(g, attention, attention.inputs[0], list(attention.inputs[1:7]))


def _split_qkv(g: _Graph, attention: Node) -> bool:
    """float16 ``Attention(*Split(t, axis=-1))`` of a [B, S, Eq + Ek + Ev] tensor ``t`` (the packed
    projection of Hugging Face's GPT-2) reading ``t`` itself."""
    model = g.model
    names = attention.inputs[:3]
    split = g.made_by(names[0], "Split")
    if split is None or split.outputs[:3] != names or len(split.outputs) != 3:
        return False
    t = split.inputs[0]
    info = model.tensors.get(t)
    if info is None or info.dtype != _F16 or len(info.shape) != 3 or int(split.attrs.get("axis", 0)) % 3 != 2:
        return False
    if not all(g.private(n, attention) for n in names):
        return False
    sizes_input = split.inputs[1] if len(split.inputs) > 1 and split.inputs[1] else None
    if sizes_input is not None:
        sizes = g.constant(sizes_input)
        if sizes is None:
            return False
        sizes = [int(v) for v in sizes.reshape(-1)]
    elif "split" in split.attrs:
        sizes = [int(v) for v in split.attrs["split"]]
    else:
        sizes = [info.shape[2] // 3] * 3 if info.shape[2] % 3 == 0 else []
    if len(sizes) != 3 or sum(sizes) != info.shape[2] or min(sizes) < 1:
        return False
    for name in names:
        model.tensors.pop(name, None)
    model.nodes.remove(split)
    attention.inputs = [t, "", "", *attention.inputs[3:]]
    attention.attrs["packed_qkv"] = sizes
    return True


def _pack_qkv(g: _Graph, attention: Node) -> bool:
    """float16 ``Attention(x @ Wq + bq, x @ Wk + bk, x @ Wv + bv)`` reading one product of x."""
    model = g.model
    names = attention.inputs[:3]
    if len(names) < 3 or len(set(names)) != 3 or not all(g.private(n, attention) for n in names):
        return False
    if _split_qkv(g, attention):
        return True
    products = [g.made_by(n, "MatMul") for n in names]
    if any(p is None or "activation" in p.attrs or len(p.inputs) not in (2, 3) for p in products):
        return False
    x = products[0].inputs[0]
    info = model.tensors.get(x)
    if info is None or info.dtype != _F16 or len(info.shape) != 3 or any(p.inputs[0] != x for p in products):
        return False
    weights = [g.constant(p.inputs[1]) for p in products]
    if any(w is None or w.dtype != _F16 or w.ndim != 2 for w in weights):
        return False
    biases = [g.constant(p.inputs[2]) if len(p.inputs) == 3 else np.zeros(w.shape[1], _F16)
              for p, w in zip(products, weights)]
    if any(b is None or b.dtype != _F16 or b.shape != (w.shape[1],) for b, w in zip(biases, weights)):
        return False
    sizes = [w.shape[1] for w in weights]
    base = attention.name or attention.outputs[0]
    w_name, b_name, qkv = (model.fresh_name(f"{base}_{what}") for what in ("qkv_weight", "qkv_bias", "qkv"))
    model.constants[w_name] = np.ascontiguousarray(np.concatenate(weights, axis=1))
    model.constants[b_name] = np.concatenate(biases)
    model.tensors[w_name] = TensorInfo(model.constants[w_name].shape, _F16)
    model.tensors[b_name] = TensorInfo((sum(sizes),), _F16)
    model.tensors[qkv] = TensorInfo((*info.shape[:2], sum(sizes)), _F16)
    product = type(attention)(f"{base}_qkv", "MatMul", "", [x, w_name, b_name], [qkv], {})
    for p in products:
        model.tensors.pop(p.outputs[0], None)
        model.nodes.remove(p)
    model.nodes.insert(model.nodes.index(attention), product)
    attention.inputs = [qkv, "", "", *attention.inputs[3:]]
    attention.attrs["packed_qkv"] = sizes
    return True

"""How the ``cpu`` member runs a chunk: one onnxruntime CPU session of the chunk's subgraph, or
the ops' numpy references.

:func:`open_engine` builds the chunk's nodes, constants and boundary tensors into an ONNX model
(:func:`submodel`) and opens it in onnxruntime; where onnxruntime is not installed, or refuses the
model (an op or a type it has no CPU kernel for), the chunk runs with numpy and the reason is
logged and kept (:attr:`Engine.note`), so the plan a session shows names what runs.

Constants of 4 KiB or more reach onnxruntime as external initializers over the same memory
(``SessionOptions.add_external_initializers``): a weight is neither copied into the ONNX model
nor limited by protobuf's 2 GiB.
"""
from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Sequence

import numpy as np

from vkpool.fusion import PRODUCT_AT
from vkpool.kernels.base import TensorInfo
from vkpool.model import Node

log = logging.getLogger("vkpool.host")

ONNXRUNTIME = "onnxruntime"
NUMPY = "numpy"
#: constants at least this large are handed to onnxruntime as external initializers, in place
EXTERNAL_BYTES = 4096


def onnxruntime_version() -> str | None:
    """The installed onnxruntime's version, or None when it cannot be imported."""
    try:
        import onnxruntime
    except ImportError:
        return None
    return str(onnxruntime.__version__)


def engine_name(setting: str) -> str:
    """What a host member with ``host.engine: setting`` runs its chunks with where onnxruntime
    takes them: ``onnxruntime <version>`` or ``numpy``."""
    version = onnxruntime_version()
    return NUMPY if setting == NUMPY or version is None else f"{ONNXRUNTIME} {version}"


def engine_label(setting: str) -> str:
    """What a host member with ``host.engine: setting`` runs its chunks with, as ``vkpool
    devices`` shows it (a chunk onnxruntime refuses still falls back to numpy)."""
    version = onnxruntime_version()
    if setting == NUMPY:
        return "numpy (host.engine: numpy)"
    if version is None:
        return "numpy (onnxruntime not installed)"
    return f"onnxruntime {version}"


class Engine:
    """What runs one host chunk: ``name`` is ``onnxruntime <version>`` or ``numpy``; ``note``
    says why a chunk that could have used onnxruntime does not ('' otherwise)."""

    def __init__(self, name: str, session: Any = None, keep: Sequence[Any] = (), note: str = "") -> None:
        self.name = name
        self.note = note
        self._session = session
        self._keep = list(keep)  # OrtValues over the constants' memory: alive while the session is

    @property
    def uses_onnxruntime(self) -> bool:
        return self._session is not None

    def run(self, feeds: Mapping[str, np.ndarray], outputs: Sequence[str]) -> dict[str, np.ndarray]:
        results = self._session.run(list(outputs), {k: np.ascontiguousarray(v) for k, v in feeds.items()})
        return dict(zip(outputs, results))

    def close(self) -> None:
        self._session = None
        self._keep = []


def _attribute_value(value: Any) -> Any:
    from onnx import numpy_helper

    if isinstance(value, np.ndarray):
        return numpy_helper.from_array(value)
    if isinstance(value, list) and value and isinstance(value[0], np.ndarray):
        return [numpy_helper.from_array(v) for v in value]
    return value


def _activation(kind: str, x: str, y: str, name: str, dtype: Any = np.float32) -> list[Any]:
    """ONNX nodes computing ``y`` = the activation ``kind`` (:data:`vkpool.kernels.ops.gemm.ACTIVATIONS`)
    of ``x`` (of type ``dtype``), in ops of opset 13: GELU as exporters spell it."""
    from onnx import helper, numpy_helper

    nodes: list[Any] = []

    def const(tag: str, value: float) -> str:
        out = f"{name}/{tag}"
        tensor = numpy_helper.from_array(np.array(value, dtype), out)
        nodes.append(helper.make_node("Constant", [], [out], name=out, value=tensor))
        return out

    def step(op: str, inputs: list[str], tag: str, out: str | None = None) -> str:
        out = out or f"{name}/{tag}"
        nodes.append(helper.make_node(op, inputs, [out], name=f"{name}/{tag}"))
        return out

    if kind == "Relu":
        step("Relu", [x], "relu", y)
    elif kind == "Gelu":  # x * 0.5 * (1 + erf(x / sqrt 2))
        erf = step("Erf", [step("Mul", [x, const("rsqrt2", 1 / math.sqrt(2))], "scaled")], "erf")
        times_x = step("Mul", [x, step("Add", [erf, const("one", 1.0)], "plus1")], "times_x")
        step("Mul", [times_x, const("half", 0.5)], "out", y)
    elif kind == "GeluTanh":  # 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))
        x3 = step("Mul", [step("Mul", [x, x], "x2"), x], "x3")
        inner = step("Add", [x, step("Mul", [x3, const("k", 0.044715)], "kx3")], "inner")
        tanh = step("Tanh", [step("Mul", [inner, const("s", math.sqrt(2 / math.pi))], "scaled")], "tanh")
        times_x = step("Mul", [x, step("Add", [tanh, const("one", 1.0)], "plus1")], "times_x")
        step("Mul", [times_x, const("half", 0.5)], "out", y)
    else:
        raise ValueError(f"{name}: fused activation {kind!r} has no ONNX spelling here")
    return nodes


def _attention(node: Node, tensors: Mapping[str, TensorInfo]) -> list[Any] | None:
    """ONNX Attention (opset 23, which :mod:`vkpool.fusion` makes of an exporter's scaled
    dot-product attention) in ops of opset 13 for the case the fusion makes: 3-D Q/K/V with as
    many key heads as query heads, an optional float or bool mask, an optional causal flag, one
    output; None for any other (the chunk then stays as it is)."""
    from onnx import helper

    a = node.attrs
    ins = list(node.inputs) + [""] * (4 - len(node.inputs))
    q, k, v, mask = ins[:4]
    heads = a.get("q_num_heads")
    if (len(node.inputs) > 4 or any(ins[4:]) or len([o for o in node.outputs if o]) != 1 or heads is None
            or a.get("kv_num_heads", heads) != heads or a.get("softcap") or int(a.get("qk_matmul_output_mode", 0))
            or int(a.get("left_window_size", -1)) != -1 or int(a.get("right_window_size", -1)) != -1
            or len(tensors[q].shape) != 3):
        return None
    (b, sq, hd), (_, sk, _), (_, _, hdv) = tensors[q].shape, tensors[k].shape, tensors[v].shape
    d, dv = hd // heads, hdv // heads
    scale = float(a["scale"]) if a.get("scale") is not None else 1.0 / math.sqrt(d)
    tag = node.outputs[0]
    nodes: list[Any] = []

    def const(name: str, value: Any) -> str:
        out = f"{tag}/{name}"
        arr = np.asarray(value)
        tensor = helper.make_tensor(out, helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape, arr.ravel().tolist())
        nodes.append(helper.make_node("Constant", [], [out], name=out, value=tensor))
        return out

    def add(op: str, inputs: list[str], name: str, **attrs: Any) -> str:
        out = f"{tag}/{name}"
        nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    heads_of = {q: (sq, d, [0, 2, 1, 3]), k: (sk, d, [0, 2, 3, 1]), v: (sk, dv, [0, 2, 1, 3])}
    split = {}
    for name, (length, size, perm) in heads_of.items():
        shaped = add("Reshape", [name, const(f"shape_{len(split)}", np.array([b, length, heads, size], np.int64))],
                     f"heads_{len(split)}")
        split[name] = add("Transpose", [shaped], f"perm_{len(split)}", perm=perm)
    scores = add("Mul", [add("MatMul", [split[q], split[k]], "qk"), const("scale", np.float32(scale))], "scaled")
    if mask:
        if tensors[mask].dtype == np.bool_:
            scores = add("Where", [mask, scores, const("masked", np.float32(-np.inf))], "masked_scores")
        else:
            scores = add("Add", [scores, mask], "masked_scores")
    if int(a.get("is_causal", 0)):
        causal = np.where(np.tril(np.ones((sq, sk), bool), k=sk - sq), 0.0, -np.inf).astype(np.float32)
        scores = add("Add", [scores, const("causal", causal)], "causal_scores")
    probs = add("Softmax", [scores], "probs", axis=-1)
    merged = add("Transpose", [add("MatMul", [probs, split[v]], "pv")], "merged", perm=[0, 2, 1, 3])
    nodes.append(helper.make_node("Reshape", [merged, const("out_shape", np.array([b, sq, heads * dv], np.int64))],
                                  [node.outputs[0]], name=f"{tag}/out"))
    return nodes


def _node_protos(node: Node, tensors: Mapping[str, TensorInfo]) -> list[Any]:
    """The ONNX node(s) of a vkpool node, with what :mod:`vkpool.fusion` folded into it written
    out again: a product's ``activation`` (Relu, GELU), a ``MatMul``'s bias (its third input), a
    ``Conv``'s residual (its fourth), the
    ``product`` a node computes itself (input 0 @ W + bias, W and the bias at
    :data:`vkpool.fusion.PRODUCT_AT`), a
    ``LayerNormalization``'s ``residual`` (input 3 added first, the sum its output 3), an
    ``Attention`` of opset 23 in the ops of older opsets where :func:`_attention` can. Anything
    else goes as it is, and onnxruntime may refuse the chunk."""
    from onnx import helper

    if node.attrs.get("product"):  # the product the node computes itself, then the node on its output
        a, w, c = (node.inputs[0], *(list(node.inputs[PRODUCT_AT[node.op_type]:]) + [""])[:2])
        x = f"{node.outputs[0]}/product"
        product = [helper.make_node("MatMul", [a, w], [f"{x}_unbiased" if c else x], name=x)]
        if c:
            product.append(helper.make_node("Add", [f"{x}_unbiased", c], [x], name=f"{x}_bias"))
        rest = Node(node.name, node.op_type, node.domain, [x, *node.inputs[1:PRODUCT_AT[node.op_type]]],
                    list(node.outputs), {k: v for k, v in node.attrs.items() if k != "product"})
        return product + _node_protos(rest, tensors)
    if node.op_type == "Attention" and node.domain in ("", "ai.onnx"):
        spelled = _attention(node, tensors)
        if spelled is not None:
            return spelled

    attrs = {k: _attribute_value(v) for k, v in node.attrs.items() if k not in ("activation", "residual")}
    inputs, outputs = list(node.inputs), list(node.outputs)
    tag = outputs[0]  # output names are unique in a graph, node names need not be
    nodes: list[Any] = []
    if node.op_type == "LayerNormalization" and node.attrs.get("residual"):
        total = outputs[3] if len(outputs) > 3 and outputs[3] else f"{tag}/residual_sum"
        nodes.append(helper.make_node("Add", [inputs[0], inputs[3]], [total], name=f"{tag}/residual"))
        inputs, outputs = [total, *inputs[1:3]], outputs[:3]
    bias = None  # added to the op's output before the activation: a MatMul's bias, a Conv's residual
    if node.op_type == "MatMul" and len(inputs) > 2 and inputs[2]:
        bias, inputs = inputs[2], inputs[:2]
    elif node.op_type == "Conv" and len(inputs) > 3 and inputs[3]:
        bias, inputs = inputs[3], inputs[:3]
        while not inputs[-1]:
            inputs.pop()
    activation = node.attrs.get("activation")
    y = outputs[0]
    product = f"{tag}/product" if bias is not None or activation is not None else y
    nodes.append(helper.make_node(node.op_type, inputs, [product, *outputs[1:]], name=node.name,
                                  domain=node.domain, **attrs))
    if bias is not None:
        biased = f"{tag}/biased" if activation is not None else y
        nodes.append(helper.make_node("Add", [product, bias], [biased], name=f"{tag}/bias"))
        product = biased
    if activation is not None:
        nodes += _activation(str(activation), product, y, tag, tensors[y].dtype if y in tensors else np.float32)
    return nodes


def _value_info(name: str, info: TensorInfo) -> Any:
    from onnx import helper

    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype)),
                                         list(info.shape))


def submodel(nodes: Sequence[Node], tensors: Mapping[str, TensorInfo], constants: Mapping[str, np.ndarray],
             inputs: Sequence[str], outputs: Sequence[str], opset: int) -> tuple[Any, dict[str, np.ndarray]]:
    """The chunk as an ONNX model, and the constants left out of it to be given as external
    initializers (name → contiguous array, ``EXTERNAL_BYTES`` or more each)."""
    import onnx
    from onnx import helper, numpy_helper

    protos = [p for node in nodes for p in _node_protos(node, tensors)]
    used = list(dict.fromkeys(n for node in nodes for n in node.inputs if n in constants))
    used += [n for n in outputs if n in constants and n not in used]
    initializers, external = [], {}
    for name in used:
        value = np.asarray(constants[name])
        if value.nbytes >= EXTERNAL_BYTES:
            external[name] = np.ascontiguousarray(value)
            t = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(value.dtype),
                                 dims=list(value.shape), data_location=onnx.TensorProto.EXTERNAL)
            entry = t.external_data.add()
            entry.key, entry.value = "location", name
            initializers.append(t)
        else:
            initializers.append(numpy_helper.from_array(value, name))
    graph = helper.make_graph(protos, "vkpool_host_chunk", [_value_info(n, tensors[n]) for n in inputs],
                              [_value_info(n, tensors[n]) for n in outputs], initializers)
    domains = sorted({n.domain for n in nodes} - {"", "ai.onnx"})
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = helper.find_min_ir_version_for(list(model.opset_import))
    return model, external


def open_engine(setting: str, nodes: Sequence[Node], tensors: Mapping[str, TensorInfo],
                constants: Mapping[str, np.ndarray], inputs: Sequence[str], outputs: Sequence[str],
                opset: int, *, label: str = "cpu") -> Engine:
    """The engine of one host chunk under ``host.engine: setting`` (auto, onnxruntime, numpy).

    ``auto`` falls back to numpy (logged, with the reason in :attr:`Engine.note`) where
    onnxruntime is missing or refuses the chunk; ``onnxruntime`` raises RuntimeError instead.
    """
    if setting == NUMPY:
        return Engine(NUMPY)
    version = onnxruntime_version()
    try:
        if version is None:
            raise RuntimeError("onnxruntime is not installed (pip install onnxruntime)")
        import onnxruntime as ort

        model, external = submodel(nodes, tensors, constants, inputs, outputs, opset)
        options = ort.SessionOptions()
        options.log_severity_level = 3  # its warnings about the subgraph's shapes are not the user's
        keep = [ort.OrtValue.ortvalue_from_numpy(v) for v in external.values()]
        if external:
            options.add_external_initializers(list(external), keep)
        session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's refusals have no common base class
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        if setting == ONNXRUNTIME:
            raise RuntimeError(f"{label}: onnxruntime cannot run this chunk ({reason}); "
                               "set host.engine: auto to let numpy run it") from exc
        log.info("%s: a chunk of %d op(s) runs with numpy: %s", label, len(nodes), reason)
        return Engine(NUMPY, note=reason)
    return Engine(f"{ONNXRUNTIME} {version}", session, keep)


__all__ = ["Engine", "open_engine", "submodel", "engine_name", "engine_label", "onnxruntime_version",
           "ONNXRUNTIME", "NUMPY"]

"""Write an ncnn ``.param``/``.bin`` pair for the benchmark workloads' ONNX graphs.

pnnx converts through torch, which the benchmark machines may lack and whose graph rewrites we can't
pin; these workloads use eight ONNX ops, so they are written directly in ncnn's text format,
layer for layer, FP32 weights:

- ``Conv`` followed by ``Add`` of a [1,C,1,1] constant -> one ``Convolution`` with ``bias_term=1``
  (what pnnx emits for a torch ``Conv2d``, whose bias the ONNX graph spells as the Add);
- ``MatMul`` (+ ``Add`` of an [N] constant) and ``Gemm`` -> ``InnerProduct``;
- ``Relu`` -> ``ReLU``; ``MaxPool`` -> ``Pooling`` (max, valid padding = floor, as ONNX);
  ``Reshape`` to [1, K] -> ``Flatten``; ``Softmax(axis=-1)`` on [1, K] -> ``Softmax`` axis 0;
- ``Add(prev, [1] zero)`` (the add chain) -> ``BinaryOp`` add with the scalar, one layer per node.

ncnn blobs drop the batch axis: [1,C,H,W] is ncnn's (c, h, w) and [1,K] or [K] its 1-D ``w``.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

MAGIC = 7767517
INPUT_BLOB = "in0"
OUTPUT_BLOB = "out0"


class UnsupportedGraph(ValueError):
    """The graph uses an op or pattern this exporter does not write."""


@dataclass
class _Writer:
    layers: list[str] = field(default_factory=list)
    blobs: int = 0
    weights: list[bytes] = field(default_factory=list)

    def layer(self, kind: str, name: str, inputs: list[str], outputs: list[str], params: str = "") -> None:
        self.blobs += len(outputs)
        line = f"{kind:<16} {name:<24} {len(inputs)} {len(outputs)} {' '.join(inputs + outputs)}"
        self.layers.append(f"{line} {params}".rstrip())

    def weight(self, array: np.ndarray) -> None:
        # A weight blob starts with a 4-byte tag; 0 means raw float32 follows.
        self.weights.append(struct.pack("<I", 0) + np.ascontiguousarray(array, dtype="<f4").tobytes())

    def raw(self, array: np.ndarray) -> None:  # biases are read without a tag
        self.weights.append(np.ascontiguousarray(array, dtype="<f4").tobytes())


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def export(model: onnx.ModelProto, param_path: Path, bin_path: Path) -> None:
    """Write ``model`` as ncnn files; input blob ``in0``, output blob ``out0``."""
    graph = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    in_shape = [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim]
    w = _Writer()
    if len(in_shape) == 4:
        _, c, h, wd = in_shape
        w.layer("Input", "input", [], [INPUT_BLOB], f"0={wd} 1={h} 2={c}")
    else:
        w.layer("Input", "input", [], [INPUT_BLOB], f"0={int(np.prod(in_shape))}")

    blob = {graph.input[0].name: INPUT_BLOB}
    fused: set[str] = set()

    def bias_add_after(out: str) -> onnx.NodeProto | None:
        users = consumers.get(out, [])
        if len(users) == 1 and users[0].op_type == "Add" and users[0].input[1] in consts:
            return users[0]
        return None

    for node in graph.node:
        if node.name in fused:
            continue
        src = blob.get(node.input[0]) if node.input else None
        if src is None:
            raise UnsupportedGraph(f"node {node.name}: input {node.input[0]!r} comes from no written layer")
        op, attrs = node.op_type, _attrs(node)
        out = node.output[0]
        if op == "Conv":
            weight = consts[node.input[1]]
            kh, kw = weight.shape[2:]
            pads = list(attrs.get("pads", [0, 0, 0, 0]))
            strides = list(attrs.get("strides", [1, 1]))
            if len(set(pads)) != 1 or strides[0] != strides[1] or attrs.get("group", 1) != 1:
                raise UnsupportedGraph(f"Conv {node.name}: only symmetric pads, square strides, group 1")
            bias = consts[node.input[2]] if len(node.input) > 2 else None
            add = bias_add_after(out) if bias is None else None
            if add is not None:
                bias, out = consts[add.input[1]].reshape(-1), add.output[0]
                fused.add(add.name)
            params = (f"0={weight.shape[0]} 1={kw} 11={kh} 3={strides[0]} 4={pads[0]} "
                      f"5={int(bias is not None)} 6={weight.size}")
            w.layer("Convolution", node.name, [src], [out], params)
            w.weight(weight)
            if bias is not None:
                w.raw(bias)
        elif op in ("MatMul", "Gemm"):
            weight = consts[node.input[1]]
            if op == "Gemm":
                if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
                    raise UnsupportedGraph(f"Gemm {node.name}: only alpha=beta=1, transA=0")
                if not attrs.get("transB", 0):
                    weight = weight.T
                bias = consts[node.input[2]] if len(node.input) > 2 else None
            else:
                weight = weight.T  # ONNX [K, N] -> ncnn [N, K]
                add = bias_add_after(out)
                bias = None
                if add is not None:
                    bias, out = consts[add.input[1]], add.output[0]
                    fused.add(add.name)
            w.layer("InnerProduct", node.name, [src], [out],
                    f"0={weight.shape[0]} 1={int(bias is not None)} 2={weight.size}")
            w.weight(weight)
            if bias is not None:
                w.raw(bias.reshape(-1))
        elif op == "Relu":
            w.layer("ReLU", node.name, [src], [out])
        elif op == "MaxPool":
            k, s = attrs["kernel_shape"], attrs.get("strides", [1, 1])
            if any(attrs.get("pads", [0])):
                raise UnsupportedGraph(f"MaxPool {node.name}: padding not written")
            w.layer("Pooling", node.name, [src], [out], f"0=0 1={k[1]} 11={k[0]} 2={s[1]} 12={s[0]} 5=1")
        elif op == "Reshape":
            shape = consts[node.input[1]].tolist()
            if len(shape) != 2 or shape[0] != 1:
                raise UnsupportedGraph(f"Reshape {node.name}: only to [1, K]")
            w.layer("Flatten", node.name, [src], [out])
        elif op == "Softmax":
            if attrs.get("axis", -1) not in (-1, 1):
                raise UnsupportedGraph(f"Softmax {node.name}: only the last axis of [1, K]")
            w.layer("Softmax", node.name, [src], [out], "0=0 1=1")
        elif op == "Add":
            const = consts.get(node.input[1])
            if const is None or const.size != 1:
                raise UnsupportedGraph(f"Add {node.name}: only Add(x, scalar constant) outside fused biases")
            w.layer("BinaryOp", node.name, [src], [out], f"0=0 1=1 2={float(const.reshape(-1)[0]):.9g}")
        else:
            raise UnsupportedGraph(f"op {op} ({node.name}) is not written by this exporter")
        blob[out] = out

    final = graph.output[0].name
    # Rename the graph output's blob to the fixed output name.
    last = w.layers[-1].split()
    if last[-1 - _param_count(last)] != final:
        raise UnsupportedGraph(f"the last written layer does not produce the graph output {final!r}")
    w.layers[-1] = _rename_last_output(w.layers[-1], final, OUTPUT_BLOB)
    param_path.write_text("\n".join([str(MAGIC), f"{len(w.layers)} {w.blobs}", *w.layers]) + "\n")
    bin_path.write_bytes(b"".join(w.weights))


def _param_count(tokens: list[str]) -> int:
    return sum(1 for t in tokens if "=" in t)


def _rename_last_output(line: str, old: str, new: str) -> str:
    tokens = line.split()
    idx = len(tokens) - 1 - _param_count(tokens)
    assert tokens[idx] == old
    tokens[idx] = new
    return " ".join(tokens)

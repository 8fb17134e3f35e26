"""The benchmark workloads (the VKML paper's Table 2, rebuilt) as ONNX models.

Every model is FP32, batch 1, opset 17, with one input ``x`` and one output ``y`` and random weights
drawn from a generator seeded by the workload's name, so two builds are byte-identical.

Reading of the workload table (docs/benchmarks.md, shared BENCHMARKS.md):

- A *conv stage* is the mnist-12 stage for every conv workload: ``Conv 5x5 pad 2 -> Add bias
  [1,C,1,1] -> Relu -> MaxPool(k, stride k)``. The table's sizes decide between this and a 3x3
  stage: with 5x5 kernels ``conv_many_255MB`` weighs 296.0 MiB and ``conv_few_15MB`` 13.06 MiB, the
  table's 296 MiB and 13 MiB; with 3x3 kernels they would weigh 293.5 MiB and 12.56 MiB.
- The spatial size goes 28 -> 14 -> 7 (-> 7 for the third stage of ``conv_many``, whose pool is 1),
  which gives the flattened widths 6272 = 128*7*7 and 12544 = 256*7*7 the table's MatMuls start from.
- ``mnist12_like`` pools 2 then 3 (28 -> 14 -> 4), hence 16*4*4 = 256 features.
- The MatMul chains have no activation between layers (the table names none); the weights are
  scaled by 1/sqrt(fan_in) so activations keep unit scale through 16 layers and the closing
  Softmax sees ordinary logits.
- ``add_chain_<N>``: input ``x`` of shape [1]; N nodes ``Add(prev, zero)`` where ``zero`` is one
  [1] initializer of value 0, each Add consuming the previous one's output.
"""
from __future__ import annotations

import argparse
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # readable by every onnxruntime that supports opset 17

ADD_CHAIN_PREFIX = "add_chain_"


class _GraphBuilder:
    """Accumulates nodes and initializers; names values ``v0, v1, ...`` in creation order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.rng = np.random.default_rng(zlib.crc32(name.encode()))
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._count = 0

    def _fresh(self, prefix: str) -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def const(self, array: np.ndarray, prefix: str = "w") -> str:
        name = self._fresh(prefix)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def weight(self, shape: tuple[int, ...], fan_in: int, gain: float = 1.0) -> str:
        array = self.rng.standard_normal(shape, dtype=np.float32)
        array *= np.float32(gain / np.sqrt(fan_in))
        return self.const(array)

    def bias(self, shape: tuple[int, ...]) -> str:
        return self.const(self.rng.uniform(-0.1, 0.1, shape).astype(np.float32), "b")

    def op(self, op_type: str, inputs: list[str], output: str | None = None, **attrs: object) -> str:
        out = output or self._fresh("v")
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self._fresh(op_type), **attrs))
        return out

    def model(self, input_shape: list[int], output_shape: list[int]) -> onnx.ModelProto:
        # The last node writes `y` directly so the graph output is a real node output.
        self.nodes[-1].output[0] = "y"
        graph = helper.make_graph(
            self.nodes,
            self.name,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, input_shape)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)],
            initializer=self.initializers,
        )
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="vkpool-bench"
        )
        model.ir_version = IR_VERSION
        return model

    # Composite layers -------------------------------------------------------------------------

    def conv_stage(self, x: str, c_in: int, c_out: int, pool: int) -> str:
        w = self.weight((c_out, c_in, 5, 5), fan_in=c_in * 25, gain=np.sqrt(2.0))
        v = self.op("Conv", [x, w], kernel_shape=[5, 5], pads=[2, 2, 2, 2], strides=[1, 1])
        v = self.op("Add", [v, self.bias((1, c_out, 1, 1))])
        v = self.op("Relu", [v])
        return self.op("MaxPool", [v], kernel_shape=[pool, pool], strides=[pool, pool])

    def reshape(self, x: str, shape: list[int]) -> str:
        return self.op("Reshape", [x, self.const(np.array(shape, dtype=np.int64), "shape")])

    def dense(self, x: str, k: int, n: int, bias: bool = True) -> str:
        v = self.op("MatMul", [x, self.weight((k, n), fan_in=k)])
        return self.op("Add", [v, self.bias((n,))]) if bias else v

    def gemm(self, x: str, k: int, n: int) -> str:
        return self.op("Gemm", [x, self.weight((k, n), fan_in=k, gain=np.sqrt(2.0)), self.bias((n,))])


def mnist12_like() -> onnx.ModelProto:
    g = _GraphBuilder("mnist12_like")
    v = g.conv_stage("x", 1, 8, pool=2)
    v = g.conv_stage(v, 8, 16, pool=3)
    v = g.reshape(v, [1, 256])
    g.dense(v, 256, 10)
    return g.model([1, 1, 28, 28], [1, 10])


def mlp() -> onnx.ModelProto:
    g = _GraphBuilder("mlp")
    v = g.reshape("x", [1, 784])
    v = g.op("Relu", [g.gemm(v, 784, 256)])
    v = g.op("Relu", [g.gemm(v, 256, 128)])
    v = g.gemm(v, 128, 10)
    g.op("Softmax", [v], axis=-1)
    return g.model([1, 1, 28, 28], [1, 10])


def _conv_net(name: str, channels: list[int], pools: list[int], widths: list[int]) -> onnx.ModelProto:
    g = _GraphBuilder(name)
    v, c_in, side = "x", 1, 28
    for c_out, pool in zip(channels, pools):
        v = g.conv_stage(v, c_in, c_out, pool)
        c_in, side = c_out, side // pool
    flat = c_in * side * side
    assert flat == widths[0], (name, flat, widths[0])
    v = g.reshape(v, [1, flat])
    for k, n in zip(widths, widths[1:]):
        v = g.dense(v, k, n)
    g.op("Softmax", [v], axis=-1)
    return g.model([1, 1, 28, 28], [1, widths[-1]])


def conv_few_15MB() -> onnx.ModelProto:
    return _conv_net("conv_few_15MB", [64, 128], [2, 2], [6272, 512, 10])


def conv_many_255MB() -> onnx.ModelProto:
    return _conv_net("conv_many_255MB", [64, 128, 256], [2, 2, 1], [12544, 4096, 4096, 2048, 10])


def _matmul_net(name: str, width: int, layers: int) -> onnx.ModelProto:
    g = _GraphBuilder(name)
    v = g.reshape("x", [1, width])
    for _ in range(layers):
        v = g.dense(v, width, width, bias=False)
    g.op("Softmax", [v], axis=-1)
    return g.model([1, width], [1, width])


#: (width, layers) of the MatMul chains: 16 * 4096^2 * 4 B = 16384^2 * 4 B = 1 GiB.
MATMUL_SPECS: dict[str, tuple[int, int]] = {
    "matmul_1GB_16layers": (4096, 16),
    "matmul_1GB_1layer": (16384, 1),
}


def matmul_1GB_16layers() -> onnx.ModelProto:
    return _matmul_net("matmul_1GB_16layers", *MATMUL_SPECS["matmul_1GB_16layers"])


def matmul_1GB_1layer() -> onnx.ModelProto:
    return _matmul_net("matmul_1GB_1layer", *MATMUL_SPECS["matmul_1GB_1layer"])


def add_chain(n: int) -> onnx.ModelProto:
    """N dependent ``Add(prev, zero)``; run it with graph fusion off (the benchmark's rule)."""
    if n < 1:
        raise ValueError(f"add_chain needs N >= 1, got {n}")
    g = _GraphBuilder(f"{ADD_CHAIN_PREFIX}{n}")
    zero = g.const(np.zeros([1], dtype=np.float32), "zero")
    v = "x"
    for _ in range(n):
        v = g.op("Add", [v, zero])
    return g.model([1], [1])


WORKLOADS: dict[str, Callable[[], onnx.ModelProto]] = {
    "mnist12_like": mnist12_like,
    "mlp": mlp,
    "conv_few_15MB": conv_few_15MB,
    "conv_many_255MB": conv_many_255MB,
    "matmul_1GB_16layers": matmul_1GB_16layers,
    "matmul_1GB_1layer": matmul_1GB_1layer,
}

ADD_CHAIN_NS = (1, 10, 100, 1000, 10000)

#: Weight bytes each workload is documented to hold (the table's "size" column).
DOCUMENTED_BYTES: dict[str, int] = {
    "mnist12_like": 25_000,
    "mlp": int(0.9 * 2**20),
    "conv_few_15MB": 13 * 2**20,
    "conv_many_255MB": 296 * 2**20,
    "matmul_1GB_16layers": 2**30,
    "matmul_1GB_1layer": 2**30,
}

#: Input shape of every workload (add chains: [1]).
INPUT_SHAPES: dict[str, tuple[int, ...]] = {
    "mnist12_like": (1, 1, 28, 28),
    "mlp": (1, 1, 28, 28),
    "conv_few_15MB": (1, 1, 28, 28),
    "conv_many_255MB": (1, 1, 28, 28),
    "matmul_1GB_16layers": (1, 4096),
    "matmul_1GB_1layer": (1, 16384),
}


def add_chain_n(name: str) -> int | None:
    """N of an ``add_chain_<N>`` name, or None for any other name."""
    if not name.startswith(ADD_CHAIN_PREFIX):
        return None
    digits = name[len(ADD_CHAIN_PREFIX):]
    if not digits.isdigit():
        raise KeyError(f"bad add-chain workload name {name!r}: expected add_chain_<N>")
    return int(digits)


def all_names(add_chain_ns: tuple[int, ...] = ADD_CHAIN_NS) -> list[str]:
    return list(WORKLOADS) + [f"{ADD_CHAIN_PREFIX}{n}" for n in add_chain_ns]


def build(name: str) -> onnx.ModelProto:
    """Build workload ``name`` (one of WORKLOADS, or ``add_chain_<N>``)."""
    n = add_chain_n(name)
    if n is not None:
        return add_chain(n)
    try:
        return WORKLOADS[name]()
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(all_names())}") from None


def symbolic_batch(model: onnx.ModelProto, dim: str = "N") -> onnx.ModelProto:
    """``model`` with the first dim of its input and output named ``dim`` (batchable): a Reshape to
    a constant shape that starts with the batch size 1 reshapes to ``-1`` there instead."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    for value in [*g.input, *g.output]:
        first = value.type.tensor_type.shape.dim[0]
        first.Clear()
        first.dim_param = dim
    shapes = {n.input[1] for n in g.node if n.op_type == "Reshape"}
    for init in g.initializer:
        if init.name in shapes:
            shape = numpy_helper.to_array(init).copy()
            if shape.size and shape[0] == 1:
                shape[0] = -1
                init.CopyFrom(numpy_helper.from_array(shape, init.name))
    return out


def input_for(name: str, seed: int = 0) -> dict[str, np.ndarray]:
    """The input feed for workload ``name``: standard normal FP32 values from ``seed``."""
    shape = (1,) if add_chain_n(name) is not None else INPUT_SHAPES.get(name)
    if shape is None:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(all_names())}")
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal(shape, dtype=np.float32)}


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the FP32 initializers (the shape constants of Reshape are not weights)."""
    total = 0
    for init in model.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            total += 4 * int(np.prod(init.dims, dtype=np.int64))
    return total


def save(name: str, out_dir: Path) -> Path:
    """Build ``name`` and write ``<out_dir>/<name>.onnx`` (plain protobuf: every model is < 2 GiB)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.onnx"
    onnx.save_model(build(name), path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workloads", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the .onnx files")
    parser.add_argument("names", nargs="*", help="workloads (default: all; add chains as add_chain_<N>)")
    parser.add_argument("--symbolic-batch", action="store_true",
                        help="write <name>-batch.onnx, whose first dim is a symbolic batch N (for dynamic batching)")
    args = parser.parse_args(argv)
    for name in args.names or all_names():
        if args.symbolic_batch:
            args.out.mkdir(parents=True, exist_ok=True)
            path = args.out / f"{name}-batch.onnx"
            onnx.save_model(symbolic_batch(build(name)), path)
        else:
            path = save(name, args.out)
        print(f"{path}  {path.stat().st_size / 2**20:.2f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

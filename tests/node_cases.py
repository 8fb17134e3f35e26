"""One-node ONNX cases run on the real Vulkan device, with the reference outputs to compare."""
from __future__ import annotations

from typing import Any

import numpy as np
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import vkpool


def run_node(pool: Any, op_type: str, inputs: list[np.ndarray | None], attrs: dict[str, Any] | None = None, *,
             constants: tuple[int, ...] = (), num_outputs: int = 1, opset: int = 21,
             expected: list[np.ndarray] | None = None, device: str | None = None,
             ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(device outputs, reference outputs) of one node; ``constants`` positions become initializers.
    ``expected`` replaces the reference evaluator where it cannot run the case; ``device`` picks
    the member (the session's default placement otherwise)."""
    names = [f"in{i}" if x is not None else "" for i, x in enumerate(inputs)]
    outs = [f"out{i}" for i in range(num_outputs)]
    node = helper.make_node(op_type, names, outs, **(attrs or {}))
    graph_inputs, inits, feeds = [], [], {}
    for i, (name, x) in enumerate(zip(names, inputs)):
        if x is None:
            continue
        if i in constants:
            inits.append(numpy_helper.from_array(x, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape))
            feeds[name] = x
    opsets = [helper.make_opsetid("", opset)]

    def model(outputs: list[Any]) -> bytes:
        graph = helper.make_graph([node], "case", graph_inputs, outputs, initializer=inits)
        return helper.make_model(graph, opset_imports=opsets).SerializeToString()

    if expected is None:
        expected = [np.asarray(e) for e in ReferenceEvaluator(
            model([helper.make_empty_tensor_value_info(o) for o in outs])).run(None, feeds)]
    typed = [helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(e.dtype), e.shape)
             for o, e in zip(outs, expected)]
    with vkpool.Session(model(typed), pool=pool, **({"device": device} if device else {})) as session:
        got = session.run(None, feeds)
    return got, expected


def assert_outputs_match(got: list[np.ndarray], expected: list[np.ndarray], rtol: float = 1e-4,
                         atol: float = 1e-5) -> None:
    """Same shapes; floats within ``rtol``/``atol``, everything else equal."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape, (g.shape, e.shape)
        if e.dtype.kind == "f":
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(g, e)


def ort_case(op: str, inputs: list[np.ndarray], attrs: dict[str, Any] | None = None, constants: tuple[int, ...] = (),
             outputs: int = 1, opset: int = 17) -> tuple[bytes, dict[str, np.ndarray], list[np.ndarray]]:
    """(model, feeds, onnxruntime's outputs) of one node; ``constants`` positions become initializers."""
    names = [f"in{i}" for i in range(len(inputs))]
    outs = [f"out{i}" for i in range(outputs)]
    graph_inputs, inits, feeds = [], [], {}
    for i, (name, x) in enumerate(zip(names, inputs)):
        if i in constants:
            inits.append(numpy_helper.from_array(x, name))
        else:
            graph_inputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape))
            feeds[name] = x
    node = helper.make_node(op, names, outs, **(attrs or {}))

    def model(values: list[Any]) -> bytes:
        graph = helper.make_graph([node], op, graph_inputs, values, initializer=inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9).SerializeToString()

    import onnxruntime as ort

    expected = ort.InferenceSession(model([helper.make_empty_tensor_value_info(o) for o in outs]),
                                    providers=["CPUExecutionProvider"]).run(None, feeds)
    typed = [helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(e.dtype), e.shape)
             for o, e in zip(outs, expected)]
    return model(typed), feeds, expected


def conv_residual_case(inputs: list[np.ndarray], attrs: dict[str, Any], residual: Any, relu: bool,
                       swap: bool = False) -> tuple[bytes, dict[str, np.ndarray], list[np.ndarray]]:
    """A residual block's sum as exporters spell it: ``[Relu](Add(Conv(x, w[, b]), r))`` (the Add's
    operands swapped with ``swap``), w and b initializers, ``r = residual(shape)`` a second input
    of the convolution's output shape; the model, its feeds and onnxruntime's outputs."""
    import onnxruntime as ort
    from onnx import TensorProto

    x, w, *b = inputs
    out = ort_case("Conv", inputs, attrs, tuple(range(1, len(inputs))))[2][0]
    r = residual(out.shape)
    weights = [numpy_helper.from_array(w, "w"), *[numpy_helper.from_array(v, "b") for v in b]]
    nodes = [helper.make_node("Conv", ["x", "w", *(["b"] if b else [])], ["h"], **attrs),
             helper.make_node("Add", ["r", "h"] if swap else ["h", "r"], ["s" if relu else "y"])]
    if relu:
        nodes.append(helper.make_node("Relu", ["s"], ["y"]))
    graph = helper.make_graph(nodes, "residual", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape),
                                                  helper.make_tensor_value_info("r", TensorProto.FLOAT, r.shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out.shape)], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=9).SerializeToString()
    feeds = {"x": x, "r": r}
    return model, feeds, ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)


def dispatches_of(op: Any, caps: Any) -> list[Any]:
    """The dispatches an op of three inputs and one output records on a device with ``caps``
    (buffer stand-ins: only the shaders, defines and grids are looked at)."""
    from vkpool.kernels.base import DispatchContext

    return op.dispatches(DispatchContext([object(), object(), object()], [object()], object(), caps, {}))

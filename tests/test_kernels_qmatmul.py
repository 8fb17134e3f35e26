"""MatMulInteger and QLinearMatMul on the real Vulkan device, against ONNX's reference evaluator:
uint8 and int8, 2-D and batched (shared or per-batch right operand), float32 and float16
scales; ConvInteger and QLinearConv against onnxruntime on the CPU (per-tensor and per-channel
weights, groups, strides, dilations, pads, bias). Exact integer results."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node

RNG = np.random.default_rng(31)


def ints(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)


@pytest.mark.parametrize("dtype,a_shape,b_shape", [
    (np.uint8, (5, 7), (7, 3)), (np.int8, (2, 5, 7), (2, 7, 3)), (np.uint8, (2, 4, 6), (6, 5)),
])
def test_matmul_integer(pool, dtype, a_shape, b_shape):
    a, b = ints(a_shape, dtype), ints(b_shape, dtype)
    zeros = [np.array([3], dtype), np.array([250 if dtype == np.uint8 else -7], dtype)]
    got, expected = run_node(pool, "MatMulInteger", [a, b, *zeros], opset=10)
    np.testing.assert_array_equal(got[0], expected[0])


@pytest.mark.parametrize("dtype,scale_type,batched", [
    (np.uint8, np.float32, False), (np.int8, np.float16, True), (np.uint8, np.float16, False),
])
def test_qlinear_matmul(pool, dtype, scale_type, batched):
    a = ints((2, 4, 9) if batched else (4, 9), dtype)
    b = ints((2, 9, 5) if batched else (9, 5), dtype)

    def scale(v: float) -> np.ndarray:
        return np.array([v], scale_type)

    zero = ints((1,), dtype)
    inputs = [a, scale(0.02), zero, b, scale(0.03), ints((1,), dtype), scale(0.5), ints((1,), dtype)]
    got, expected = run_node(pool, "QLinearMatMul", inputs, opset=21)
    np.testing.assert_array_equal(got[0], expected[0])


# -- ConvInteger and QLinearConv, against onnxruntime on the CPU ------------------------------------

def _ort_case(pool, op: str, inputs: list[np.ndarray], attrs: dict, constants: tuple[int, ...], opset: int):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the expected outputs")
    import vkpool
    from onnx import helper, numpy_helper

    names = [f"in{i}" for i in range(len(inputs))]
    graph_inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)
                    for i, (n, x) in enumerate(zip(names, inputs)) if i not in constants]
    inits = [numpy_helper.from_array(x, n) for i, (n, x) in enumerate(zip(names, inputs)) if i in constants]
    feeds = {n: x for i, (n, x) in enumerate(zip(names, inputs)) if i not in constants}

    def model(out):
        graph = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], op, graph_inputs, [out], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9).SerializeToString()

    want = ort.InferenceSession(model(helper.make_empty_tensor_value_info("y")),
                                providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    typed = helper.make_tensor_value_info("y", helper.np_dtype_to_tensor_dtype(want.dtype), want.shape)
    with vkpool.Session(model(typed), pool=pool) as session:
        got = session.run(None, feeds)[0]
    assert got.shape == want.shape and got.dtype == want.dtype
    return got, want


@pytest.mark.parametrize("x_shape,w_shape,attrs", [
    ((1, 3, 9, 9), (4, 3, 3, 3), {"pads": [1, 1, 1, 1]}),
    ((2, 4, 8, 7), (6, 2, 3, 2), {"group": 2, "strides": [2, 1], "dilations": [1, 2]}),
    ((1, 2, 11), (3, 2, 4), {"auto_pad": "SAME_UPPER"}),
])
def test_conv_integer(pool, x_shape, w_shape, attrs):
    """onnxruntime takes a per-tensor weight zero point only (QLinearConv covers per channel)."""
    x, w = ints(x_shape, np.uint8), ints(w_shape, np.uint8)
    w_zero = ints((), np.uint8)
    got, want = _ort_case(pool, "ConvInteger", [x, w, np.array(131, np.uint8), w_zero], attrs, (1, 3), 10)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("x_type,w_type,per_channel,bias", [
    (np.uint8, np.uint8, False, True), (np.uint8, np.int8, True, True), (np.int8, np.int8, True, False),
    (np.uint8, np.uint8, True, True),
])
def test_qlinear_conv(pool, x_type, w_type, per_channel, bias):
    m = 5
    x, w = ints((1, 4, 10, 10), x_type), ints((m, 4, 3, 3), w_type)
    shape = (m,) if per_channel else ()
    w_scale = RNG.uniform(0.002, 0.01, shape).astype(np.float32)
    w_zero = np.zeros(shape, w_type) if w_type == np.int8 else ints(shape, w_type)  # onnxruntime: int8 weights are symmetric
    inputs = [x, np.array(0.05, np.float32), ints((), x_type), w, w_scale, w_zero, np.array(0.7, np.float32),
              ints((), x_type)]
    if bias:
        inputs.append(RNG.integers(-2000, 2000, m).astype(np.int32))
    got, want = _ort_case(pool, "QLinearConv", inputs, {"pads": [1, 1, 1, 1], "strides": [2, 2]},
                          tuple(range(1, len(inputs))), 10)
    np.testing.assert_array_equal(got, want)

"""Load-time fusion of biases and Relus into products (GELU and attention: tests/test_fusion_transformer.py): which graphs are rewritten, and that the
fused kernels (direct and implicit-GEMM convolution, GEMV in both layouts, tiled GEMM) give the
unfused graph's outputs on the real Vulkan device (ONNX reference evaluator, rtol 1e-4, atol 1e-5)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from vkpool.model import load_model
from vkpool.session import Session

RNG = np.random.default_rng(7)


def _const(name: str, shape: tuple[int, ...]) -> object:
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(np.float32), name)


def _model(nodes, x_shape, y_shape, inits, outputs=("y",)) -> bytes:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, list(y_shape)) for o in outputs]
    g = helper.make_graph(nodes, "g", [x], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def _conv_block(channels: int, in_channels: int = 3, bias_shape=None, conv_bias: bool = False) -> bytes:
    bias_shape = bias_shape or (1, channels, 1, 1)
    inits = [_const("w", (channels, in_channels, 3, 3)), _const("b", bias_shape)]
    conv_inputs = ["x", "w"]
    if conv_bias:
        inits.append(_const("cb", (channels,)))
        conv_inputs.append("cb")
    nodes = [helper.make_node("Conv", conv_inputs, ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    return _model(nodes, (1, in_channels, 12, 12), (1, channels, 12, 12), inits)


def _check(pool, model: bytes, x_shape: tuple[int, ...]) -> None:
    x = RNG.standard_normal(x_shape).astype(np.float32)
    expected = ReferenceEvaluator(model).run(None, {"x": x})[0]
    with Session(model, pool=pool) as sess:
        got = sess.run(None, {"x": x})[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("channels,in_channels", [(4, 3), (32, 8)], ids=["direct", "implicit-gemm"])
@pytest.mark.parametrize("conv_bias", [False, True])
def test_conv_add_relu_becomes_one_conv(pool, channels, in_channels, conv_bias):
    model = _conv_block(channels, in_channels, conv_bias=conv_bias)
    loaded = load_model(model)
    assert [(n.op_type, n.attrs.get("activation")) for n in loaded.nodes] == [("Conv", "Relu")]
    assert len(loaded.nodes[0].inputs) == 3
    _check(pool, model, (1, in_channels, 12, 12))


@pytest.mark.parametrize("m,trans_b", [(1, 0), (1, 1), (8, 0)], ids=["gemv", "gemv_t", "gemm"])
def test_matmul_add_relu_becomes_one_gemm(pool, m, trans_b):
    k, n = 96, 40
    if trans_b:
        inits = [_const("w", (n, k)), _const("b", (n,))]
        nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["a"], transB=1), helper.make_node("Relu", ["a"], ["y"])]
    else:
        inits = [_const("w", (k, n)), _const("b", (1, n))]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["a"]),
                 helper.make_node("Relu", ["a"], ["y"])]
    model = _model(nodes, (m, k), (m, n), inits)
    loaded = load_model(model)
    assert [(n.op_type, n.attrs.get("activation")) for n in loaded.nodes] == [("Gemm" if trans_b else "MatMul", "Relu")]
    assert len(loaded.nodes[0].inputs) == 3
    _check(pool, model, (m, k))


def test_what_is_not_fused():
    # a bare [C] bias broadcasts along the last axis, not the channels
    assert [n.op_type for n in load_model(_conv_block(12, bias_shape=(12,))).nodes] == ["Conv", "Add", "Relu"]
    # an intermediate the caller sees keeps its value
    inits = [_const("w", (4, 3, 3, 3)), _const("b", (1, 4, 1, 1))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Add", ["c", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["y"])]
    seen = _model(nodes, (1, 3, 12, 12), (1, 4, 12, 12), inits, outputs=("y", "a"))
    assert [n.op_type for n in load_model(seen).nodes] == ["Conv", "Relu"]
    # an intermediate with two readers stays
    nodes2 = nodes[:2] + [helper.make_node("Relu", ["a"], ["r"]), helper.make_node("Add", ["r", "a"], ["y"])]
    two = _model(nodes2, (1, 3, 12, 12), (1, 4, 12, 12), inits)
    assert [n.op_type for n in load_model(two).nodes] == ["Conv", "Relu", "Add"]
    # a bias that broadcasts along more than the last axis stays an Add
    inits3 = [_const("w", (6, 5)), _const("b", (3, 5))]
    nodes3 = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["y"])]
    batched = _model(nodes3, (2, 3, 6), (2, 3, 5), inits3)
    assert [n.op_type for n in load_model(batched).nodes] == ["MatMul", "Add"]
    # and fuse=False leaves every graph alone
    assert [n.op_type for n in load_model(_conv_block(4), fuse=False).nodes] == ["Conv", "Add", "Relu"]

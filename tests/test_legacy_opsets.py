"""Models exported at opsets 7, 8 and 9 (the classic model-zoo CNNs) load and match onnxruntime
on the CPU (float32 rtol 1e-4, atol 1e-5), on the real Vulkan device.

Each model uses the ops of such CNNs with their old forms: BatchNormalization's ``spatial``
attribute, Dropout with its mask output (read by nobody), Upsample with ``scales`` as an
attribute (7, 8) or an input (9), Pad, Clip, Slice, Squeeze and Unsqueeze with attributes where
those opsets had them, Softmax's 2-D coercion, MaxPool with its indices output, Gemm, Sum,
Concat, Flatten, Reshape, LRN, AveragePool and GlobalAveragePool."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import vkpool

ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the expected outputs")


def _w(rng: np.random.Generator, *shape: int, scale: float = 0.3) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def classic_cnn(opset: int) -> onnx.ModelProto:
    """x [1, 3, 16, 16] → two branches of Conv/BatchNorm/Relu/Dropout/pooling → Concat → ... →
    Gemm → Softmax; every node in the form the opset defines."""
    rng = np.random.default_rng(opset)
    inits = {
        "w1": _w(rng, 8, 3, 3, 3), "b1": _w(rng, 8), "scale": 1 + _w(rng, 8, scale=0.1), "bias": _w(rng, 8),
        "mean": _w(rng, 8, scale=0.1), "var": 1 + np.abs(_w(rng, 8)), "w2": _w(rng, 8, 8, 1, 1),
        "fc_w": _w(rng, 10, 16 * 4 * 4, scale=0.05), "fc_b": _w(rng, 10), "shape": np.array([1, 4, 4], np.int64),
    }
    bn_attrs = {"epsilon": 1e-5, "momentum": 0.9} | ({"spatial": 1} if opset < 9 else {})
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "scale", "bias", "mean", "var"], ["bn"], **bn_attrs),
        helper.make_node("Relu", ["bn"], ["r1"]),
        helper.make_node("Dropout", ["r1"], ["d1", "d1_mask"], ratio=0.3),
        helper.make_node("MaxPool", ["d1"], ["p1"] + (["p1_idx"] if opset >= 8 else []), kernel_shape=[2, 2],
                         strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2"], ["c2"]),
        helper.make_node("Clip", ["c2"], ["clip"], min=-0.5, max=0.8),
        helper.make_node("LRN", ["clip"], ["lrn"], size=3, alpha=1e-3, beta=0.75, bias=1.0),
        helper.make_node("Pad", ["lrn"], ["pad"], pads=[0, 0, 1, 1, 0, 0, 1, 1], mode="constant", value=0.0),
        helper.make_node("AveragePool", ["pad"], ["ap"], kernel_shape=[3, 3], strides=[1, 1]),
        helper.make_node("Sum", ["ap", "p1", "c2"], ["sum"]),
        helper.make_node("Upsample", ["sum", "up_scales"] if opset >= 9 else ["sum"], ["up"], mode="nearest",
                         **({} if opset >= 9 else {"scales": [1.0, 1.0, 2.0, 2.0]})),
        helper.make_node("Concat", ["up", "d1"], ["cat"], axis=1),
        helper.make_node("Slice", ["cat"], ["sl"], axes=[2, 3], starts=[0, 0], ends=[16, 16]),
        helper.make_node("MaxPool", ["sl"], ["p2"], kernel_shape=[4, 4], strides=[4, 4]),
        helper.make_node("Flatten", ["p2"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["fc"], transB=1, alpha=1.0, beta=1.0),
        helper.make_node("Unsqueeze", ["fc"], ["fc3"], axes=[2]),
        helper.make_node("Squeeze", ["fc3"], ["fc2"], axes=[2]),
        helper.make_node("Softmax", ["fc2"], ["y"], axis=1),
        helper.make_node("GlobalAveragePool", ["cat"], ["gap"]),
        helper.make_node("Reshape", ["gap", "shape"], ["feat"]),
    ]
    if opset >= 9:
        inits["up_scales"] = np.array([1.0, 1.0, 2.0, 2.0], np.float32)
    # IR 3, as exporters of that time wrote it: every initializer is also a graph input
    weights = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
               for k, v in inits.items()]
    graph = helper.make_graph(
        nodes, f"cnn{opset}", [helper.make_tensor_value_info("x", T.FLOAT, [1, 3, 16, 16]), *weights],
        [helper.make_tensor_value_info("y", T.FLOAT, [1, 10]), helper.make_tensor_value_info("feat", T.FLOAT, [1, 4, 4])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=3)


def softmax_3d(opset: int) -> onnx.ModelProto:
    """Softmax before opset 13 flattens to 2-D at ``axis``: on [2, 3, 4] with axis 1, one softmax
    over 12 values per batch row."""
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=1)], "softmax",
                              [helper.make_tensor_value_info("x", T.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 3, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=3)


def _compare(pool: Any, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    data = model.SerializeToString()
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    with vkpool.Session(data, pool=pool) as session:
        got = session.run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("opset", [7, 8, 9])
def test_classic_cnn_at_a_legacy_opset(pool, opset):
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)
    _compare(pool, classic_cnn(opset), {"x": x})


@pytest.mark.parametrize("opset", [7, 11])
def test_softmax_flattens_before_opset_13(pool, opset):
    x = np.random.default_rng(2).standard_normal((2, 3, 4)).astype(np.float32)
    _compare(pool, softmax_3d(opset), {"x": x})


@pytest.mark.parametrize("opset", [7, 8])
def test_batchnorm_per_activation_statistics(pool, opset):
    """spatial=0 (opsets 7 and 8): mean and variance per channel and position."""
    rng = np.random.default_rng(3)
    stats = {"scale": 1 + _w(rng, 4, 3, 3, scale=0.1), "bias": _w(rng, 4, 3, 3), "mean": _w(rng, 4, 3, 3),
             "var": 1 + np.abs(_w(rng, 4, 3, 3))}
    node = helper.make_node("BatchNormalization", ["x", *stats], ["y"], spatial=0, epsilon=1e-3)
    graph = helper.make_graph([node], "bn", [helper.make_tensor_value_info("x", T.FLOAT, [2, 4, 3, 3])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [2, 4, 3, 3])],
                              [numpy_helper.from_array(v, k) for k, v in stats.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=4)
    _compare(pool, model, {"x": rng.standard_normal((2, 4, 3, 3)).astype(np.float32)})


def test_an_output_nobody_reads_and_nobody_can_type_is_dropped():
    """Dropout-7's mask has no inferred shape; nobody reads it, so it leaves the node."""
    from vkpool.model import load_model

    loaded = load_model(classic_cnn(7), fuse=False)
    dropout = next(n for n in loaded.nodes if n.op_type == "Dropout")
    assert dropout.outputs == ["d1"]


def test_batchnorm_statistics_outputs_are_not_dropped(pool):
    """Before opset 14, BatchNormalization's statistics outputs select training mode (onnxruntime
    then normalises by the batch's statistics): nobody reads them, yet leaving them out would
    change Y, so such a model is refused rather than run in inference mode."""
    from vkpool.model import ModelError, load_model
    from vkpool.kernels.base import OpError

    stats = [numpy_helper.from_array(np.ones(4, np.float32), k) for k in ("s", "b", "m", "v")]
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "rm", "rv", "sm", "sv"])
    graph = helper.make_graph([node], "bn", [helper.make_tensor_value_info("x", T.FLOAT, [1, 4, 2, 2])],
                              [helper.make_tensor_value_info("y", T.FLOAT, [1, 4, 2, 2])], stats)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], ir_version=4)
    with pytest.raises((ModelError, OpError)):
        with vkpool.Session(model.SerializeToString(), pool=pool) as session:
            session.run(None, {"x": np.ones((1, 4, 2, 2), np.float32)})
    assert load_model(classic_cnn(9)).nodes  # the same op without those outputs loads

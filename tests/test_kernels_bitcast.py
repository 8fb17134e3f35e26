"""BitCast on the real Vulkan device: a view of the input's bytes under another type of the same
width, as a model output (copied out) and as the input of a further node (aliased)."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import vkpool
from node_cases import run_node


@pytest.mark.parametrize("source,target", [
    (np.float32, np.int32), (np.uint16, np.int16), (np.bool_, np.uint8), (np.int64, np.float64),
])
def test_bitcast_output(pool, source, target):
    x = (np.arange(-6, 6) * 3).astype(source).reshape(3, 4)
    want = x.view(target)
    attrs = {"to": helper.np_dtype_to_tensor_dtype(np.dtype(target))}
    got, _ = run_node(pool, "BitCast", [x], attrs, opset=26, expected=[want])
    assert got[0].dtype == want.dtype
    np.testing.assert_array_equal(got[0].view(np.uint8), want.view(np.uint8))


def test_bitcast_feeds_another_node(pool):
    nodes = [helper.make_node("BitCast", ["x"], ["bits"], to=TensorProto.INT32),
             helper.make_node("Add", ["bits", "one"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [5])],
                              initializer=[helper.make_tensor("one", TensorProto.INT32, [], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26)])
    x = np.array([1.0, -2.5, 0.0, 3e38, -0.0], np.float32)
    with vkpool.Session(model.SerializeToString(), pool=pool) as session:
        (y,) = session.run(None, {"x": x})
    np.testing.assert_array_equal(y, x.view(np.int32) + 1)

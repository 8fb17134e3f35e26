"""Large inline weights read in place from the model file: the same arrays protobuf would give,
and the rest of the model parsed without them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from vkpool import inline_weights
from vkpool.model import ModelError, load_model


def _model(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    weights = {
        "big": rng.standard_normal((64, 512)).astype(np.float32),  # 128 KiB: read in place
        "small": rng.standard_normal((4,)).astype(np.float32),  # stays in the message
        "idx": np.arange(20000, dtype=np.int64),  # 160 KiB of int64
    }
    nodes = [helper.make_node("MatMul", ["x", "big"], ["y"]), helper.make_node("Add", ["z", "small"], ["s"]),
             helper.make_node("Identity", ["idx"], ["i"])]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 512]),
         helper.make_tensor_value_info("s", TensorProto.FLOAT, [4]),
         helper.make_tensor_value_info("i", TensorProto.INT64, [20000])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
        doc_string="a graph with a doc string after its initializers",
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    return path, weights


def test_large_weights_are_views_of_the_file_and_the_rest_parses(tmp_path):
    path, weights = _model(tmp_path)
    data, in_place = inline_weights.read(path)
    assert sorted(in_place) == [0, 2] and len(data) < 2000
    proto = onnx.load_model_from_string(data)
    assert proto.graph.doc_string == "a graph with a doc string after its initializers"
    assert [i.name for i in proto.graph.initializer] == ["big", "small", "idx"]
    assert not proto.graph.initializer[0].HasField("raw_data")
    np.testing.assert_array_equal(numpy_helper.to_array(proto.graph.initializer[1]), weights["small"])
    for index, name in ((0, "big"), (2, "idx")):
        assert not in_place[index].flags.writeable
        np.testing.assert_array_equal(in_place[index], weights[name])
    loaded = load_model(path)  # Identity of a constant folds: its output is the weight
    for name, value in (("big", weights["big"]), ("small", weights["small"]), ("i", weights["idx"])):
        np.testing.assert_array_equal(loaded.constants[name], value)
    inline_weights.release(in_place[0])  # pages dropped, values read again from the file
    np.testing.assert_array_equal(in_place[0], weights["big"])


def test_truncated_file_is_not_an_onnx_model(tmp_path):
    path, _ = _model(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelError, match="not an ONNX model"):
        load_model(path)

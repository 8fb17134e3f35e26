from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from vkpool.model import LoadedModel, ModelError, load_model


def _model(nodes, inputs, outputs, inits=(), opset=17, value_info=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits), value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _mlp(batch_dim="N") -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    return _model(
        [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
         helper.make_node("Add", ["h", "b"], ["a"], name="add"),
         helper.make_node("Relu", ["a"], ["y"], name="relu")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch_dim, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch_dim, 4])],
        [w, b],
    )


def test_loads_all_sources_with_static_shapes(tmp_path: Path) -> None:
    proto = _mlp()
    path = tmp_path / "m.onnx"
    onnx.save(proto, path)
    for src in (proto, proto.SerializeToString(), path, str(path)):
        m = load_model(src, fuse=False)  # the unfused graph keeps every intermediate tensor
        assert isinstance(m, LoadedModel)
        assert [n for n, _ in m.inputs] == ["x"]
        assert m.inputs[0][1].shape == (1, 8)
        assert m.tensors["h"].shape == (1, 4) and m.tensors["h"].dtype == np.float32
        assert m.outputs[0][1].shape == (1, 4)
        assert m.op_types() == [("MatMul", ""), ("Add", ""), ("Relu", "")]
        assert m.opset == 17
        assert load_model(src).op_types() == [("MatMul", "")]  # bias and Relu fused (vkpool.fusion)
        assert set(m.constants) == {"w", "b"}
        np.testing.assert_array_equal(m.constants["w"], numpy_helper.to_array(proto.graph.initializer[0]))
    # the caller's proto still holds its weights
    assert len(proto.graph.initializer) == 2 and proto.graph.initializer[0].raw_data


def test_batch_and_named_dims_bind() -> None:
    assert load_model(_mlp(), batch=5, fuse=False).tensors["a"].shape == (5, 4)
    assert load_model(_mlp(), dims={"N": 3}).outputs[0][1].shape == (3, 4)
    anonymous = _mlp(batch_dim=None)
    assert load_model(anonymous, batch=2).tensors["y"].shape == (2, 4)


def test_unbound_symbolic_dim_names_the_tensor() -> None:
    proto = _model(
        [helper.make_node("Relu", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "L"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "L"])],
    )
    with pytest.raises(ModelError, match=r"'x'.*L"):
        load_model(proto)
    assert load_model(proto, dims={"L": 7}).tensors["y"].shape == (1, 7)


def test_not_onnx(tmp_path: Path) -> None:
    for data in (b"", b"hello, this is text", os.urandom(64)):
        with pytest.raises(ModelError, match="not an ONNX model"):
            load_model(data)
    path = tmp_path / "x.onnx"
    path.write_text("{ not onnx }")
    with pytest.raises(ModelError, match="not an ONNX model"):
        load_model(path)


def test_checker_failure_is_model_error() -> None:
    bad = _model(
        [helper.make_node("Relu", ["missing"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    with pytest.raises(ModelError, match="checker"):
        load_model(bad)


def test_shape_chain_folds_to_static_reshape() -> None:
    # y = Reshape(x, Concat(Gather(Shape(x), 0), [-1])): the shape subgraph folds away
    proto = _model(
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
         helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
         helper.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
         helper.make_node("Reshape", ["x", "shape"], ["r"]),
         helper.make_node("Relu", ["r"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", None])],
        [numpy_helper.from_array(np.array(0, np.int64), "zero"),
         numpy_helper.from_array(np.array([0], np.int64), "axes"),
         numpy_helper.from_array(np.array([-1], np.int64), "minus1")],
    )
    m = load_model(proto, batch=2)
    assert m.op_types() == [("Reshape", ""), ("Relu", "")]
    shape = m.constants["shape"]
    assert shape.dtype == np.int64
    np.testing.assert_array_equal(shape, [2, -1])
    assert m.tensors["y"].shape == (2, 12)
    assert set(m.constants) == {"shape"}  # zero/axes/minus1 no longer used


def test_constant_and_constant_of_shape_fold_with_dtype() -> None:
    proto = _model(
        [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.array([2, 3], np.int64))),
         helper.make_node("ConstantOfShape", ["c"], ["z"],
                          value=numpy_helper.from_array(np.array([1.5], np.float16))),
         helper.make_node("Cast", ["z"], ["zf"], to=TensorProto.FLOAT),
         helper.make_node("Add", ["x", "zf"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    m = load_model(proto)
    assert m.op_types() == [("Add", "")]
    assert m.constants["zf"].dtype == np.float32
    np.testing.assert_array_equal(m.constants["zf"], np.full((2, 3), 1.5, np.float32))
    assert m.nodes[0].inputs == ["x", "zf"]


def test_size_of_static_tensor_folds_and_random_does_not() -> None:
    proto = _model(
        [helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("Size", ["r"], ["n"]),
         helper.make_node("RandomUniform", [], ["u"], shape=[2], dtype=TensorProto.FLOAT),
         helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
         helper.make_node("Add", ["u", "nf"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("r", TensorProto.FLOAT, [4, 5])],
    )
    m = load_model(proto)
    assert [t for t, _ in m.op_types()] == ["Relu", "RandomUniform", "Add"]
    assert m.constants["nf"] == np.float32(20)


def test_optional_input_and_attrs() -> None:
    proto = _model(
        [helper.make_node("Clip", ["x", "", "hi"], ["y"], name="clip"),
         helper.make_node("Transpose", ["y"], ["t"], perm=[1, 0])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [3, 2])],
        [numpy_helper.from_array(np.array(1.0, np.float32), "hi")],
    )
    m = load_model(proto)
    assert m.nodes[0].inputs == ["x", "", "hi"]
    assert m.nodes[1].attrs == {"perm": [1, 0]}
    assert "" not in m.tensors


# -- external data --------------------------------------------------------------------------------


def _external_model(folder: Path, location: str, weights: np.ndarray | None = None) -> Path:
    w = weights if weights is not None else np.arange(16, dtype=np.float32).reshape(4, 4)
    proto = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(w, "w")],
    )
    onnx.external_data_helper.convert_model_to_external_data(
        proto, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    onnx.save(proto, path)  # writes weights.bin next to it
    if location != "weights.bin":
        for init in proto.graph.initializer:
            for entry in init.external_data:
                if entry.key == "location":
                    entry.value = location
        path.write_bytes(proto.SerializeToString())
    return path


def test_external_data_inside_folder_is_mapped(tmp_path: Path) -> None:
    path = _external_model(tmp_path / "model", "weights.bin")
    m = load_model(path)
    np.testing.assert_array_equal(m.constants["w"], np.arange(16, dtype=np.float32).reshape(4, 4))
    assert not m.constants["w"].flags.writeable  # a read-only map, not a copy


def test_external_data_symlink_inside_folder_is_read(tmp_path: Path) -> None:
    # a link that stays inside the model's folder names a file of the model: it is read
    _external_model(tmp_path / "model", "weights.bin")
    (tmp_path / "model" / "alias.bin").symlink_to("weights.bin")
    path = _external_model(tmp_path / "model", "alias.bin")
    m = load_model(path)
    np.testing.assert_array_equal(m.constants["w"], np.arange(16, dtype=np.float32).reshape(4, 4))


@pytest.mark.parametrize("attack", ["dotdot", "absolute", "symlink_out", "symlink_dir_out", "hardlink"])
def test_external_data_escapes_are_refused(tmp_path: Path, attack: str) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(16, dtype=np.float32).tobytes())
    folder = tmp_path / "model"
    folder.mkdir()
    if attack == "dotdot":
        location, match = "../secret.bin", r"'\.\.'"
    elif attack == "absolute":
        location, match = str(secret), "relative path"
    elif attack == "symlink_out":
        (folder / "link.bin").symlink_to(secret)
        location, match = "link.bin", "outside the model's folder"
    elif attack == "symlink_dir_out":
        (folder / "sub").symlink_to(tmp_path)
        location, match = "sub/secret.bin", "outside the model's folder"
    else:
        os.link(secret, folder / "hard.bin")
        location, match = "hard.bin", "hard links"
    path = _external_model(folder, location)
    with pytest.raises(ModelError, match=match):
        load_model(path)


def test_external_data_too_short_is_refused(tmp_path: Path) -> None:
    path = _external_model(tmp_path, "weights.bin")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ModelError, match="needs 64"):
        load_model(path)


def test_bytes_with_external_data_is_refused(tmp_path: Path) -> None:
    path = _external_model(tmp_path, "weights.bin")
    with pytest.raises(ModelError, match="external data"):
        load_model(path.read_bytes())

"""The benchmark workloads match the documented table: structure, sizes, and they run."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from bench import workloads as wl

SMALL = ["mnist12_like", "mlp", "conv_few_15MB", "conv_many_255MB"]

EXPECTED_OPS: dict[str, dict[str, int]] = {
    "mnist12_like": {"Conv": 2, "Add": 3, "Relu": 2, "MaxPool": 2, "Reshape": 1, "MatMul": 1},
    "mlp": {"Reshape": 1, "Gemm": 3, "Relu": 2, "Softmax": 1},
    "conv_few_15MB": {"Conv": 2, "Add": 4, "Relu": 2, "MaxPool": 2, "Reshape": 1, "MatMul": 2, "Softmax": 1},
    "conv_many_255MB": {"Conv": 3, "Add": 7, "Relu": 3, "MaxPool": 3, "Reshape": 1, "MatMul": 4, "Softmax": 1},
    "matmul_1GB_16layers": {"Reshape": 1, "MatMul": 16, "Softmax": 1},
    "matmul_1GB_1layer": {"Reshape": 1, "MatMul": 1, "Softmax": 1},
}

EXPECTED_OUT = {"mnist12_like": (1, 10), "mlp": (1, 10), "conv_few_15MB": (1, 10), "conv_many_255MB": (1, 10)}


@pytest.fixture(scope="module")
def built() -> dict[str, onnx.ModelProto]:
    return {name: wl.build(name) for name in SMALL}


def _run_cpu(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(["y"], feed)[0]


def _check_interface(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    assert [i.name for i in model.graph.input] == ["x"]
    assert [o.name for o in model.graph.output] == ["y"]
    assert model.opset_import[0].version == wl.OPSET
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT


@pytest.mark.parametrize("name", SMALL)
def test_small_workload_matches_table(name: str, built: dict[str, onnx.ModelProto]) -> None:
    model = built[name]
    _check_interface(model)
    assert Counter(n.op_type for n in model.graph.node) == Counter(EXPECTED_OPS[name])
    size = wl.weight_bytes(model)
    assert abs(size - wl.DOCUMENTED_BYTES[name]) <= 0.10 * wl.DOCUMENTED_BYTES[name], size
    y = _run_cpu(model, wl.input_for(name))
    assert y.shape == EXPECTED_OUT[name] and y.dtype == np.float32
    assert np.all(np.isfinite(y))
    if model.graph.node[-1].op_type == "Softmax":
        assert y.sum() == pytest.approx(1.0, abs=1e-5)
        assert y.max() < 0.99, "logits so large that softmax is one-hot would make comparisons blind"


def test_conv_stages_are_5x5_pad_2() -> None:
    for conv in (n for n in wl.build("conv_few_15MB").graph.node if n.op_type == "Conv"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in conv.attribute}
        assert attrs["kernel_shape"] == [5, 5] and attrs["pads"] == [2, 2, 2, 2]


def test_builds_are_deterministic() -> None:
    assert wl.build("conv_few_15MB").SerializeToString() == wl.build("conv_few_15MB").SerializeToString()
    np.testing.assert_array_equal(wl.input_for("mlp", seed=3)["x"], wl.input_for("mlp", seed=3)["x"])
    assert not np.array_equal(wl.input_for("mlp", seed=3)["x"], wl.input_for("mlp", seed=4)["x"])


@pytest.mark.parametrize("name", list(wl.MATMUL_SPECS))
def test_matmul_workloads_size_and_structure(name: str) -> None:
    # The 1 GiB models take ~10 s each to build; check their arithmetic and a narrow twin instead.
    width, layers = wl.MATMUL_SPECS[name]
    assert abs(layers * width * width * 4 - wl.DOCUMENTED_BYTES[name]) <= 0.10 * wl.DOCUMENTED_BYTES[name]
    twin = wl._matmul_net(name, 64, layers)
    _check_interface(twin)
    assert Counter(n.op_type for n in twin.graph.node) == Counter(EXPECTED_OPS[name])
    y = _run_cpu(twin, {"x": np.ones((1, 64), np.float32)})
    assert y.shape == (1, 64) and y.sum() == pytest.approx(1.0, abs=1e-5)
    assert wl.INPUT_SHAPES[name] == (1, width)


#: workloads run on lavapipe at this width instead of their own (each takes half a minute whole)
NARROWED = {"matmul_1GB_16layers": 1024, "matmul_1GB_1layer": 8192}


@pytest.mark.parametrize("name", wl.all_names())
def test_every_workload_runs_on_the_vulkan_device_and_matches_onnxruntime(name: str, pool, tmp_path: Path) -> None:
    """From a file as users load them, full size but for the two 1 GiB chains, which run narrower
    (`make bench` runs them whole): the single product's weight still larger than the storage
    buffer range of the device, so that it is read in ranges."""
    from vkpool.session import Session

    if name in NARROWED:
        model = wl._matmul_net(name, NARROWED[name], wl.MATMUL_SPECS[name][1])
        assert Counter(n.op_type for n in model.graph.node) == Counter(EXPECTED_OPS[name])
        if wl.MATMUL_SPECS[name][1] == 1:
            assert NARROWED[name] ** 2 * 4 > max(m.info.max_storage_buffer_range for m in pool.vulkan_members)
    else:
        model = wl.build(name)
    if name in wl.MATMUL_SPECS and name not in NARROWED:
        assert wl.weight_bytes(model) == wl.DOCUMENTED_BYTES[name]
        assert Counter(n.op_type for n in model.graph.node) == Counter(EXPECTED_OPS[name])
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    feed = wl.input_for(name)
    if name in NARROWED:
        feed = {"x": feed["x"][:, :NARROWED[name]].copy()}
    expected = _run_cpu(model, feed)
    del model
    with Session(str(path), pool=pool) as sess:
        (got,) = sess.run(None, feed)
    # max|vkpool - onnxruntime| / max|onnxruntime|, FP32
    assert np.max(np.abs(got - expected)) <= 1e-4 * np.max(np.abs(expected)), name


@pytest.mark.parametrize("n", [1, 10, 1000])
def test_add_chain_is_dependent_adds_of_zero(n: int) -> None:
    model = wl.build(f"add_chain_{n}")
    _check_interface(model)
    nodes = model.graph.node
    assert len(nodes) == n and all(node.op_type == "Add" for node in nodes)
    (zero,) = model.graph.initializer
    assert list(zero.dims) == [1] and onnx.numpy_helper.to_array(zero)[0] == 0.0
    prev = "x"
    for node in nodes:  # each Add consumes the previous output, so nothing runs in parallel
        assert node.input[0] == prev and node.input[1] == zero.name
        prev = node.output[0]
    assert prev == "y"
    feed = wl.input_for(f"add_chain_{n}")
    np.testing.assert_array_equal(_run_cpu(model, feed), feed["x"])


def test_unknown_names_are_refused() -> None:
    with pytest.raises(KeyError, match="unknown workload"):
        wl.build("resnet50")
    with pytest.raises(KeyError):
        wl.build("add_chain_ten")
    with pytest.raises(ValueError):
        wl.build("add_chain_0")


def test_cli_writes_onnx_files(tmp_path: Path) -> None:
    assert wl.main(["--out", str(tmp_path), "mlp", "add_chain_10"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["add_chain_10.onnx", "mlp.onnx"]
    onnx.checker.check_model(str(tmp_path / "mlp.onnx"))

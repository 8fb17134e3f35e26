"""Shapes as exporters write them, on the real Vulkan device against onnxruntime on the CPU
(float32 rtol 1e-4, atol 1e-5): -1 for a dynamic dim (Paddle2ONNX), one dim_param name for dims
that differ ("?" for height and width), dims without a name, declared output and value_info
shapes the graph contradicts (the graph wins, with a warning, as in onnxruntime), outputs with a
type but no shape; and symbolic dims bound by each run's feeds, compiled per distinct shape and
kept in a bounded cache."""
from __future__ import annotations

import os
import warnings
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from vkpool.kernels.base import OpError
from vkpool.model import DeclaredShapeWarning, ModelError, UnboundDims, load_model
from vkpool.session import InvalidInput, Session

ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the expected outputs")
RNG = np.random.default_rng(21)


def conv_model(in_shape: list[Any], out_shape: list[Any] | None, value_info: list[Any] = ()) -> onnx.ModelProto:
    """Conv 3→4 (3x3, pad 1) → Relu → MaxPool 2x2: works at any height and width."""
    w = numpy_helper.from_array((RNG.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    y = helper.make_tensor_value_info("y", T.FLOAT, out_shape)
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", T.FLOAT, in_shape)], [y], [w],
                              value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def expected(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def compare(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def image(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def test_minus_one_dims_bind_per_run(pool):
    """Paddle2ONNX's -1: the load used to divide by it."""
    model = conv_model([-1, 3, -1, -1], [-1, 4, -1, -1])
    with Session(model.SerializeToString(), pool=pool) as s:
        assert [i.shape for i in s.get_inputs()] == [[None, 3, None, None]]
        for shape in [(1, 3, 8, 12), (2, 3, 6, 6), (1, 3, 8, 12)]:
            x = image(*shape)
            compare(s.run(None, {"x": x}), expected(model, {"x": x}))
        assert (s.shapes.counters.compiles, s.shapes.counters.reuses) == (2, 1)


def test_one_name_for_dims_that_differ(pool):
    model = conv_model(["N", 3, "?", "?"], ["N", 4, "?", "?"])
    with Session(model.SerializeToString(), pool=pool) as s:
        x = image(1, 3, 10, 6)  # "?" is 10 and 6 at once
        compare(s.run(None, {"x": x}), expected(model, {"x": x}))


def test_unnamed_dims_and_dims_precompile(pool):
    model = conv_model([1, 3, "H", None], [1, 4, None, None])
    with pytest.raises(UnboundDims, match=r"input 'x' axis 3 \(no name\)"):
        load_model(model)
    with Session(model.SerializeToString(), pool=pool, dims={"H": 8}) as s:
        # H alone does not bind the unnamed axis: compiled at the first run
        assert s.shapes.counters.compiles == 0
        x = image(1, 3, 8, 4)
        compare(s.run(None, {"x": x}), expected(model, {"x": x}))
        assert s.shapes.counters.compiles == 1
        assert s.plan is not None and s.stats.dispatches > 0


def test_dims_precompile_and_other_shapes_still_run(pool):
    model = conv_model(["N", 3, "H", "W"], ["N", 4, "h", "w"])
    with Session(model.SerializeToString(), pool=pool, dims={"H": 8, "W": 8}, shape_cache=2) as s:
        assert s.get_inputs()[0].shape == [1, 3, 8, 8]
        assert s.get_inputs(symbolic=True)[0].shape == [None, 3, None, None]
        x = image(1, 3, 8, 8)
        compare(s.run(None, {"x": x}), expected(model, {"x": x}))
        assert s.shapes.counters.compiles == 0  # the shapes compiled at load ran it
        for h in (4, 6, 10, 4):
            x = image(2, 3, h, 6)
            compare(s.run(None, {"x": x}), expected(model, {"x": x}))
        counters = s.shapes.counters
        assert (counters.compiles, counters.evictions) == (4, 2)  # 4 was evicted by 6 and 10
        assert len(s.shapes.shapes) == 2
        compare(s.submit({"x": x}).result(), expected(model, {"x": x}))


def test_runs_of_several_shapes_from_threads(pool):
    from concurrent.futures import ThreadPoolExecutor

    model = conv_model([1, 3, "H", "W"], None)
    shapes = [(1, 3, 4, 4), (1, 3, 6, 4), (1, 3, 4, 8)] * 3
    feeds = [{"x": image(*shape)} for shape in shapes]
    with Session(model.SerializeToString(), pool=pool, shape_cache=3) as s:
        with ThreadPoolExecutor(3) as threads:
            results = list(threads.map(lambda f: s.run(None, f), feeds, timeout=120))
        for f, got in zip(feeds, results):
            compare(got, expected(model, f))
        assert s.shapes.counters.compiles == 3 and s.shapes.counters.evictions == 0


def test_a_fixed_dim_that_differs_names_the_input_and_axis(pool):
    model = conv_model([-1, 3, -1, -1], None)
    with Session(model.SerializeToString(), pool=pool) as s:
        with pytest.raises(InvalidInput, match=r"input 'x' must have shape \['\?', 3, '\?', '\?'\], got \[1, 4, 8, 8\] "
                                               r"\(axis 1\)"):
            s.run(None, {"x": image(1, 4, 8, 8)})
        with pytest.raises(InvalidInput, match=r"\(rank 4\)"):
            s.run(None, {"x": image(3, 8, 8)})
        # a size the graph cannot take is refused naming the shapes, and the session stays usable
        with pytest.raises(OpError, match=r"input shapes x \[1, 3, 1, 1\]: MaxPool"):
            s.run(None, {"x": image(1, 3, 1, 1)})
        x = image(1, 3, 4, 4)
        compare(s.run(None, {"x": x}), expected(model, {"x": x}))


def test_output_with_a_type_but_no_shape(pool):
    model = conv_model([1, 3, 8, 8], None)
    assert not model.graph.output[0].type.tensor_type.HasField("shape")
    assert load_model(model).outputs[0][1].shape == (1, 4, 4, 4)
    with Session(model.SerializeToString(), pool=pool) as s:
        x = image(1, 3, 8, 8)
        compare(s.run(None, {"x": x}), expected(model, {"x": x}))


def test_declared_shapes_the_graph_contradicts_warn_and_the_graph_wins(pool):
    wrong_vi = [helper.make_tensor_value_info("c", T.FLOAT, [1, 4, 5, 5]),
                helper.make_tensor_value_info("r", T.FLOAT, [7])]
    model = conv_model([1, 3, 8, 8], [1, 4, 8, 8], wrong_vi)
    with pytest.warns(DeclaredShapeWarning, match=r"'y' declared \[1, 4, 8, 8\], computed \[1, 4, 4, 4\]"):
        loaded = load_model(model, cache=False)
    assert loaded.outputs[0][1].shape == (1, 4, 4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeclaredShapeWarning)
        with Session(model.SerializeToString(), pool=pool) as s:
            x = image(1, 3, 8, 8)
            truthful = onnx.ModelProto.FromString(model.SerializeToString())
            del truthful.graph.value_info[:]
            truthful.graph.output[0].type.tensor_type.ClearField("shape")
            compare(s.run(None, {"x": x}), expected(truthful, {"x": x}))


def test_agreeing_declarations_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeclaredShapeWarning)
        load_model(conv_model([1, 3, 8, 8], [1, 4, "h", 4], [helper.make_tensor_value_info("c", T.FLOAT, [1, 4, 8, 8])]))


def test_the_daemon_binds_shapes_per_request():
    """Through the daemon: a model whose H and W are "?" runs at several sizes, each compared with
    onnxruntime; the published inputs keep the shapes compiled at load. Models vkpool refuses at
    load get typed error replies (an OverflowError once reached the daemon's log)."""
    from test_daemon_e2e import Daemon
    from test_daemon_support import short_folder
    from vkpool.daemon import errors as E

    model = conv_model(["N", 3, "?", "?"], None)
    with short_folder("vks") as path:
        daemon = Daemon(path)
        try:
            with daemon.client() as client:
                session = client.session(model.SerializeToString(), dims={"?": 8})
                assert list(session.get_inputs()[0].shape) == [1, 3, 8, 8]
                for shape in [(1, 3, 8, 8), (2, 3, 6, 10)]:
                    x = image(*shape)
                    compare(session.run(None, {"x": x}), expected(model, {"x": x}))
                with pytest.raises(Exception, match=r"input 'x' must have shape"):
                    session.run(None, {"x": image(1, 2, 8, 8)})
                # sizes no device holds, an opset out of range and a vendor op: typed error replies
                huge = _one([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", T.FLOAT,
                                                                                                     [BIG, BIG])])
                with pytest.raises(E.ModelError, match="refuses tensors over 4 TiB"):
                    client.load_model(huge)
                with pytest.raises(E.ModelError, match="opset 9999"):
                    client.load_model(_one([helper.make_node("Relu", ["x"], ["y"])], [X11], opset=9999))
                with pytest.raises(E.UnsupportedOp, match=r"FusedConv \(domain com.microsoft\)"):
                    client.load_model(_one([helper.make_node("FusedConv", ["x"], ["y"], domain="com.microsoft")], [X11]))
                x = image(1, 3, 5, 5)  # and the daemon serves on
                compare(session.run(None, {"x": x}), expected(model, {"x": x}))
        finally:
            assert daemon.stop() == 0


# -- sizes that cannot exist, opsets and domains vkpool cannot run ---------------------------------

BIG = 2 ** 40


def _one(nodes: list[Any], inputs: list[Any], inits: dict[str, np.ndarray] | None = None, opset: int = 17,
         out_type: int = T.FLOAT) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", out_type, None)],
                              [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9).SerializeToString()


SHAPE = {"s": np.array([BIG, BIG], np.int64)}
X11 = helper.make_tensor_value_info("x", T.FLOAT, [1, 1])


@pytest.mark.parametrize("name,model", [
    ("declared", _one([helper.make_node("Relu", ["x"], ["y"])], [helper.make_tensor_value_info("x", T.FLOAT, [BIG, BIG])])),
    ("ConstantOfShape", _one([helper.make_node("ConstantOfShape", ["s"], ["y"])], [], SHAPE)),
    ("Expand", _one([helper.make_node("Expand", ["x", "s"], ["y"])], [X11], SHAPE)),
    ("Reshape", _one([helper.make_node("Reshape", ["x", "s"], ["y"])], [X11], SHAPE)),
])
def test_sizes_past_any_device_are_refused_at_load(pool, name, model):
    """2^40 x 2^40 elements: an OverflowError from the planner reached the daemon's log before."""
    with pytest.raises(ModelError, match=r"refuses tensors over 4 TiB|Dimension product overflow"):
        Session(model, pool=pool)


@pytest.mark.parametrize("op", ["ConstantOfShape", "Expand"])
def test_sizes_past_any_device_computed_at_run_time_are_refused(pool, op):
    inputs = [helper.make_tensor_value_info("s", T.INT64, [2])] + ([X11] if op == "Expand" else [])
    node = helper.make_node(op, ["x", "s"] if op == "Expand" else ["s"], ["y"])
    feeds = {"x": np.ones((1, 1), np.float32)} if op == "Expand" else {}
    with Session(_one([node], inputs), pool=pool) as s:
        with pytest.raises(ModelError, match=r"tensor 'y' of shape \[1099511627776, 1099511627776\].*over 4 TiB"):
            s.run(None, {**feeds, "s": np.array([BIG, BIG], np.int64)})
        assert s.run(None, {**feeds, "s": np.array([3, 5], np.int64)})[0].shape == (3, 5)


def test_an_opset_newer_than_onnx_knows_is_refused_naming_the_range():
    import onnx.defs

    model = _one([helper.make_node("Relu", ["x"], ["y"])], [X11], opset=9999)
    with pytest.raises(ModelError, match=f"opset 9999; vkpool loads opsets up to {onnx.defs.onnx_opset_version()}"):
        load_model(model)


def test_an_old_opset_loads_unless_one_of_its_ops_changed_since(pool):
    """Opset 6's Add broadcasts by attributes no kernel reads: refused, naming Add. Relu (the same
    definition from opset 6 on) and Not (unchanged since opset 1) load at their old opsets and run."""
    add = _one([helper.make_node("Add", ["x", "x"], ["y"])], [X11], opset=6)
    with pytest.raises(ModelError, match="opset 6, where Add has an older definition"):
        load_model(add)
    x = np.array([[-2.0]], np.float32)
    with Session(_one([helper.make_node("Relu", ["x"], ["y"])], [X11], opset=6), pool=pool) as s:
        np.testing.assert_array_equal(s.run(None, {"x": x})[0], np.maximum(x, 0))
    bools = helper.make_tensor_value_info("b", T.BOOL, [1, 3])
    not_model = _one([helper.make_node("Not", ["b"], ["y"])], [bools], opset=1, out_type=T.BOOL)
    b = np.array([[True, False, True]])
    with Session(not_model, pool=pool) as s:
        np.testing.assert_array_equal(s.run(None, {"b": b})[0], ~b)


def test_a_vendor_domain_is_refused_first_naming_op_and_domain():
    from vkpool.kernels.base import UnsupportedOp

    node = helper.make_node("FusedConv", ["x"], ["y"], domain="com.microsoft")
    model = _one([node, helper.make_node("Gelu", ["y"], ["z"], domain="com.microsoft")], [X11])
    with pytest.raises(UnsupportedOp, match=r"FusedConv \(domain com.microsoft\), Gelu \(domain com.microsoft\)"):
        load_model(model)


def test_the_loaded_model_cache_keeps_the_symbolic_axes(tmp_path, monkeypatch):
    monkeypatch.setenv("VKPOOL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "m.onnx"
    onnx.save(conv_model(["N", 3, "H", 8], None), path)
    os.utime(path, (1e9, 1e9))  # a file changed just now is not cached yet
    first = load_model(path, dims={"H": 8})
    assert list((tmp_path / "cache" / "models").glob("*.vkm"))
    again = load_model(path, dims={"H": 8})  # from the cache this time
    assert first.symbolic == again.symbolic == {"x": (0, 2)}


def test_an_op_without_kernel_is_refused_at_load_even_when_shapes_bind_per_run(pool):
    """Nothing is compiled before the first run of such a model, but an op no kernel runs is
    refused when the session opens, as for any model."""
    from vkpool.kernels.base import UnsupportedOp

    graph = helper.make_graph(
        [helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0), helper.make_node("Unique", ["m"], ["y"])],
        "unique", [helper.make_tensor_value_info("x", T.FLOAT, [1, "L"])], [helper.make_tensor_value_info("y", T.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    with pytest.raises(UnsupportedOp, match="does not support: Unique"):
        Session(model.SerializeToString(), pool=pool)

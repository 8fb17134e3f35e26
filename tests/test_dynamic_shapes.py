"""Models whose shapes depend on run-time values, cut by vkpool.Session (vkpool.dynamic), on the
real Vulkan device. Expected outputs come from onnx's ReferenceEvaluator (and onnxruntime's CPU
provider for one model); integer and index outputs must match exactly, float outputs within
rtol 1e-5 and atol 1e-6 (float32 throughout; a device reduction sums in another order)."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from vkpool.cut import Graph, find_cut
from vkpool.dynamic import DynamicModel
from vkpool.kernels.base import OpError
from vkpool.memory import DeviceOutOfMemory
from vkpool.model import load_model
from vkpool.session import Session

RTOL, ATOL = 1e-5, 1e-6


def _model(nodes: list[Any], inputs: list[Any], outputs: list[Any],
           inits: dict[str, np.ndarray] | None = None, opset: int = 17) -> onnx.ModelProto:
    initializers = [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    # IR 9: what the onnxruntime the tests compare with reads
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _vi(name: str, dtype: int, shape: list[Any]) -> Any:
    return helper.make_tensor_value_info(name, dtype, shape)


def _check(session: Session, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    got = session.run(None, feeds)
    want = ReferenceEvaluator(model).run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
        else:
            np.testing.assert_array_equal(g, w)
    return got


def nonzero_model() -> onnx.ModelProto:
    """NonZero of a computed mask; its indices gather from the input, then arithmetic."""
    return _model([
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("NonZero", ["r"], ["nz"]),
        helper.make_node("Transpose", ["nz"], ["idx"]),
        helper.make_node("GatherND", ["x", "idx"], ["picked"]),
        helper.make_node("Mul", ["picked", "scale"], ["scaled"]),
        helper.make_node("ReduceMean", ["x"], ["x_mean"], keepdims=0),
        helper.make_node("Add", ["scaled", "x_mean"], ["y"]),
    ],
        [_vi("x", T.FLOAT, [4, 6])], [_vi("y", T.FLOAT, ["n"]), _vi("nz", T.INT64, [2, "n"])],
        {"scale": np.float32(1.5)})


def topk_model() -> onnx.ModelProto:
    """TopK whose k is computed from an input's values and shape: max(n) + rank(x) - 2."""
    return _model([
        helper.make_node("ReduceMax", ["n"], ["n_max"], keepdims=1),
        helper.make_node("Cast", ["n_max"], ["n_int"], to=T.INT64),
        helper.make_node("Shape", ["x"], ["x_shape"]),
        helper.make_node("Size", ["x_shape"], ["rank"]),
        helper.make_node("Add", ["n_int", "rank"], ["k_plus"]),
        helper.make_node("Sub", ["k_plus", "two"], ["k"]),
        helper.make_node("TopK", ["x", "k"], ["top", "top_idx"], axis=1),
        helper.make_node("Sigmoid", ["top"], ["y"]),
    ], [_vi("x", T.FLOAT, [3, 12]), _vi("n", T.FLOAT, [4])],
        [_vi("y", T.FLOAT, [3, "k"]), _vi("top_idx", T.INT64, [3, "k"])], {"two": np.array([2], np.int64)})


def range_model() -> onnx.ModelProto:
    """Range whose limit is computed from an input's values; the suffix scales it by a device result."""
    return _model([
        helper.make_node("ReduceSum", ["a"], ["a_sum"], keepdims=0),
        helper.make_node("Cast", ["a_sum"], ["limit"], to=T.INT64),
        helper.make_node("Range", ["zero", "limit", "one"], ["steps"]),
        helper.make_node("Cast", ["steps"], ["steps_f"], to=T.FLOAT),
        helper.make_node("ReduceMean", ["a"], ["a_mean"], keepdims=0),
        helper.make_node("Mul", ["steps_f", "a_mean"], ["y"]),
    ], [_vi("a", T.FLOAT, [5])], [_vi("y", T.FLOAT, ["m"])],
        {"zero": np.array(0, np.int64), "one": np.array(1, np.int64)})


def two_cuts_model() -> onnx.ModelProto:
    """TopK with a fed k, then a NonZero of its (device-computed) values: the suffix is cut again."""
    return _model([
        helper.make_node("TopK", ["x", "k"], ["top", "top_idx"], axis=0),
        helper.make_node("Greater", ["top", "zero_f"], ["positive"]),
        helper.make_node("NonZero", ["positive"], ["nz"]),
        helper.make_node("Transpose", ["nz"], ["idx"]),
        helper.make_node("GatherND", ["top", "idx"], ["picked"]),
        helper.make_node("Neg", ["picked"], ["y"]),
    ], [_vi("x", T.FLOAT, [10]), _vi("k", T.INT64, [1])],
        [_vi("y", T.FLOAT, ["n"]), _vi("top_idx", T.INT64, ["k"])], {"zero_f": np.float32(0)})


def test_nonzero_of_a_runtime_tensor_then_device_ops(pool) -> None:
    model = nonzero_model()
    with Session(model.SerializeToString(), pool=pool) as s:
        assert s.dynamic is not None
        assert [p.op_type for p in s.dynamic.points] == ["NonZero"]
        assert [a.shape for a in s.get_outputs()] == [[None], [2, None]]
        rng = np.random.default_rng(1)
        for _ in range(3):
            _check(s, model, {"x": rng.standard_normal((4, 6)).astype(np.float32)})
        # NonZero folded on the host; the gather and the arithmetic ran on the device
        suffix = s.dynamic.latest
        assert {n.op_type for n in suffix.model.nodes} == {"GatherND", "Mul", "Add"}
        _check(s, model, {"x": np.zeros((4, 6), np.float32)})  # no non-zero at all


def test_topk_with_a_computed_k(pool) -> None:
    model = topk_model()
    with Session(model.SerializeToString(), pool=pool) as s:
        assert [(p.op_type, p.tensor, p.input_name) for p in s.dynamic.points] == [("TopK", "k", "K")]
        x = np.random.default_rng(2).standard_normal((3, 12)).astype(np.float32)
        for top in (3.0, 7.0, 12.0, 0.0):  # k = top + 2 - 2
            y, idx = _check(s, model, {"x": x, "n": np.array([top, 0, 0, -4], np.float32)})
            assert y.shape == (3, int(top))
        feeds = {"x": x, "n": np.array([5, 1, 0, -4], np.float32)}
        cpu = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        want = cpu.run(None, feeds)
        got = s.run(None, feeds)
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL)
        np.testing.assert_array_equal(got[1], want[1])


def test_range_with_a_limit_computed_from_input_values(pool) -> None:
    model = range_model()
    with Session(model.SerializeToString(), pool=pool) as s:
        assert [p.input_name for p in s.dynamic.points] == ["limit"]
        for a in ([1, 2, 0, 1, 3], [0.5, 0.2, 0, 0, 0], [2, 2, 2, 2, 2], [-3, 0, 0, 0, 0]):
            _check(s, model, {"a": np.array(a, np.float32)})


def test_two_cut_points_in_sequence(pool) -> None:
    model = two_cuts_model()
    with Session(model.SerializeToString(), pool=pool) as s:
        assert s.dynamic.prefix is None  # k comes straight from an input
        assert s.dynamic.split.later == 1  # the NonZero depends on TopK's run-time output
        x = np.array([3, -1, 4, -1, 5, -9, 2, -6, 5, 3], np.float32)
        for k in (4, 6, 10, 4):
            _check(s, model, {"x": x, "k": np.array([k], np.int64)})
        inner = s.dynamic.latest
        assert isinstance(inner, DynamicModel)
        assert [p.op_type for p in inner.points] == ["NonZero"]
        assert inner.prefix is not None  # TopK and Greater, recorded once for k = 4
        assert (s.dynamic.counters.suffix_compiles, s.dynamic.counters.suffix_reuses) == (3, 1)
        assert "cut model" in s.plan.to_text() and "NonZero" in s.plan.to_text()


def test_same_values_compile_once_and_the_cache_is_bounded(pool) -> None:
    model = topk_model()
    with Session(model.SerializeToString(), pool=pool, suffix_cache=2) as s:
        c = s.dynamic.counters
        x = np.random.default_rng(3).standard_normal((3, 12)).astype(np.float32)

        def run(top: float) -> None:
            s.run(None, {"x": x, "n": np.array([top, 0, 0, 0], np.float32)})

        run(4)
        run(4)
        run(4)
        assert (c.suffix_compiles, c.suffix_reuses, c.suffix_evictions) == (1, 2, 0)
        run(5)
        run(4)
        assert (c.suffix_compiles, c.suffix_reuses, c.suffix_evictions) == (2, 3, 0)
        run(6)  # a third value: the least recently used (5) goes
        assert (c.suffix_compiles, c.suffix_evictions, s.dynamic.suffixes) == (3, 1, 2)
        run(4)
        assert c.suffix_compiles == 3
        run(5)
        assert c.suffix_compiles == 4
        assert c.prefix_compiles == 1


def test_the_prefix_is_recorded_once(pool, monkeypatch) -> None:
    member = pool.vulkan_members[0]
    recorded: list[int] = []
    real = member.device.record

    def counting(cmd: Any, commands: Any) -> Any:  # counts, then records for real
        recorded.append(len(commands))
        return real(cmd, commands)

    monkeypatch.setattr(member.device, "record", counting)
    model = topk_model()
    with Session(model.SerializeToString(), pool=pool, device=member.id) as s:
        assert len(recorded) == 1  # the prefix, at load
        prefix_chunk = s.dynamic.prefix._chunk
        x = np.ones((3, 12), np.float32)
        for top in (2, 3, 2, 3, 2):
            s.run(None, {"x": x, "n": np.array([top, 0, 0, 0], np.float32)})
        assert s.dynamic.counters.suffix_compiles == 2
        assert len(recorded) == 1 + 2  # one recording per suffix compiled, none per run
        assert s.dynamic.prefix._chunk is prefix_chunk


def test_static_models_are_not_cut(pool) -> None:
    model = _model([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["r"]),
                    helper.make_node("Relu", ["r"], ["y"])],
                   [_vi("x", T.FLOAT, [2, 3])], [_vi("y", T.FLOAT, [2, 3])])
    with Session(model.SerializeToString(), pool=pool) as s:
        assert s.dynamic is None and not s.model.unresolved
        assert type(s.plan).__name__ == "SingleMemberPlan"
        _check(s, model, {"x": np.arange(-3, 3, dtype=np.float32).reshape(2, 3)})


def test_cut_points_follow_values_not_shapes() -> None:
    # Reshape(data, Shape(x)) reads only x's static shape (folded at load); Reshape(data, Cast(s))
    # reads s's values: the one cut point, with Cast before it in the prefix
    nodes = [helper.make_node("Shape", ["x"], ["x_shape"]),
             helper.make_node("Reshape", ["data", "x_shape"], ["a"]),
             helper.make_node("Cast", ["s"], ["s64"], to=T.INT64),
             helper.make_node("Reshape", ["data", "s64"], ["b"])]
    model = _model(nodes, [_vi("x", T.FLOAT, [2, 3]), _vi("data", T.FLOAT, [6]), _vi("s", T.INT32, [2])],
                   [_vi("a", T.FLOAT, [2, 3]), _vi("b", T.FLOAT, ["p", "q"])])
    loaded = load_model(model.SerializeToString(), partial=True)
    split = find_cut(Graph.of(loaded))
    assert split is not None
    assert [(p.op_type, p.tensor, p.input_name) for p in split.points] == [("Reshape", "s64", "shape")]
    assert [n.op_type for n in split.prefix] == ["Reshape", "Cast"]
    assert [n.op_type for n in split.suffix] == ["Reshape"]


def test_the_plan_says_where_the_model_is_cut(pool) -> None:
    model = topk_model()
    with Session(model.SerializeToString(), pool=pool) as s:
        text = s.plan.to_text()
        assert "prefix: 4 ops recorded once" in text  # Shape and Size folded at load
        assert "suffix: 2 ops compiled per value of tensor 'k' (K of TopK" in text
        assert "compiled on the first run" in text
        s.run(None, {"x": np.ones((3, 12), np.float32), "n": np.array([3, 0, 0, 0], np.float32)})
        as_dict = s.plan.to_dict()
        assert as_dict["cut"]["points"][0]["tensor"] == "k" and as_dict["suffix"] is not None
        assert "K of TopK" in s.plan.to_text() and "= [3]" in s.plan.to_text()
        assert sum(s.memory_by_member().values()) > 0


def test_bad_values_raise_errors_that_say_where(pool) -> None:
    model = topk_model()
    with Session(model.SerializeToString(), pool=pool) as s:
        x = np.ones((3, 12), np.float32)
        with pytest.raises(OpError, match=r"k=13 is out of range.*K of TopK .* = \[13\]"):
            s.run(None, {"x": x, "n": np.array([13, 0, 0, 0], np.float32)})
        # the session still serves good values
        assert s.run(None, {"x": x, "n": np.array([2, 0, 0, 0], np.float32)})[0].shape == (3, 2)


def test_a_value_too_large_for_the_budget_is_refused_not_crashed() -> None:
    model = range_model()
    from vkpool.pool import DevicePool

    pool = DevicePool.from_config(None)
    try:
        member = pool.vulkan_members[0].id
        with Session(model.SerializeToString(), pool=pool, device=member, budgets={member: "8MiB"}) as s:
            with pytest.raises(DeviceOutOfMemory):
                s.run(None, {"a": np.array([1e8, 0, 0, 0, 0], np.float32)})  # 100 M steps: 800 MB
            _check(s, model, {"a": np.array([1, 2, 3, 0, 0], np.float32)})
    finally:
        pool.close()


def test_a_plan_for_the_whole_graph_is_refused_for_a_cut_model(pool) -> None:
    with pytest.raises(ValueError, match="devices="):
        Session(topk_model().SerializeToString(), pool=pool, plan={"TopK": pool.vulkan_members[0].id})


def test_parts_are_planned_over_the_given_members(pool) -> None:
    model = range_model()
    ids = [pool.vulkan_members[0].id, "cpu"]
    with Session(model.SerializeToString(), pool=pool, devices=ids) as s:
        _check(s, model, {"a": np.array([1, 1, 2, 0, 0], np.float32)})
        assert type(s.dynamic.prefix.plan).__name__ == "MultiMemberPlan"
        assert "Compiled, run by threads of this process:" in s.plan.to_text()


def test_concurrent_runs_share_and_evict_suffixes_safely(pool) -> None:
    from concurrent.futures import ThreadPoolExecutor

    model = two_cuts_model()
    x = np.array([3, -1, 4, -1, 5, -9, 2, -6, 5, 3], np.float32)
    reference = ReferenceEvaluator(model)
    want = {k: reference.run(None, {"x": x, "k": np.array([k], np.int64)}) for k in range(1, 11)}
    with Session(model.SerializeToString(), pool=pool, suffix_cache=2) as s:
        def run(k: int) -> bool:
            got = s.run(None, {"x": x, "k": np.array([k], np.int64)})
            return all(np.array_equal(g, w) for g, w in zip(got, want[k]))

        with ThreadPoolExecutor(4) as threads:
            assert all(threads.map(run, [1 + (i * 7) % 10 for i in range(40)]))
        c = s.dynamic.counters
        assert c.suffix_compiles + c.suffix_reuses == 40 and s.dynamic.suffixes <= 2


def test_the_onnx_backend_compiles_per_fed_value() -> None:
    import vkpool.backend as backend

    model = two_cuts_model()
    assert backend.is_compatible(model)
    rep = backend.prepare(model, "CPU")
    try:
        x = np.array([3, -1, 4, -1, 5, -9, 2, -6, 5, 3], np.float32)
        for k in (2, 5, 2):
            got = rep.run([x, np.array([k], np.int64)])
            want = ReferenceEvaluator(model).run(None, {"x": x, "k": np.array([k], np.int64)})
            assert all(np.array_equal(g, w) for g, w in zip(got, want))
        counters = rep.session.dynamic.counters
        assert (counters.suffix_compiles, counters.suffix_reuses) == (2, 1)
    finally:
        rep.close()

"""If, Loop, Scan and NonMaxSuppression on the real Vulkan device, against onnxruntime (CPU).

The onnx package's node test cases of these ops, and graphs built here for what those leave out:
an If nested in a Loop's body, a Loop stopped by a condition its body computes, a Scan in reverse
along another axis, outer-scope values read by subgraphs, If branches of different output shapes,
loop-carried values whose shapes change, and the refusals that must come at load.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import vkpool
from vkpool.dynamic import kernel_nodes
from vkpool.kernels.base import UnsupportedOp
from vkpool.model import ModelError

ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the expected outputs")

#: float32 outputs within 1e-5 relative; the absolute 1e-6 only matters for values near zero
RTOL, ATOL = 1e-5, 1e-6


def _model(nodes, inputs, outputs, inits=(), opset=17) -> bytes:
    graph = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=9).SerializeToString()


def _matches(pool, model: bytes, feeds: dict[str, np.ndarray]) -> vkpool.Session:
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    session = vkpool.Session(model, pool=pool)
    try:
        got = session.run(None, feeds)
        for g, e in zip(got, expected, strict=True):
            assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, g.dtype, e.shape, e.dtype)
            if e.dtype.kind == "f":
                np.testing.assert_allclose(g, e, rtol=RTOL, atol=ATOL)
            else:
                np.testing.assert_array_equal(g, e)
    except BaseException:
        session.close()
        raise
    return session


def _vi(name, shape, dtype=T.FLOAT):
    return h.make_tensor_value_info(name, dtype, shape)


# -- the onnx package's node test cases ----------------------------------------------------------

NODE_CASES = ["test_if", "test_loop11", "test_scan_sum", "test_scan9_sum", "test_range_float_type_positive_delta_expanded",
              "test_range_int32_type_negative_delta_expanded", "test_nonmaxsuppression_center_point_box_format",
              "test_nonmaxsuppression_flipped_coordinates", "test_nonmaxsuppression_identical_boxes",
              "test_nonmaxsuppression_iou_threshold_boundary", "test_nonmaxsuppression_limit_output_size",
              "test_nonmaxsuppression_single_box", "test_nonmaxsuppression_suppress_by_IOU",
              "test_nonmaxsuppression_suppress_by_IOU_and_scores", "test_nonmaxsuppression_two_batches",
              "test_nonmaxsuppression_two_classes"]


def _node_case(name: str) -> tuple[bytes, list[dict[str, np.ndarray]]]:
    """The model of one onnx node test case and the feeds of each of its data sets (only the
    modules of these ops are imported: generating every case takes many seconds)."""
    import importlib

    for module in ("if_", "loop", "scan", "nonmaxsuppression", "rangeop"):
        importlib.import_module(f"onnx.backend.test.case.node.{module}")
    from onnx.backend.test.case.node import _NodeTestCases

    case = next((c for c in _NodeTestCases if c.name == name), None)
    if case is None:
        pytest.fail(f"the installed onnx has no node test case {name}")
    names = [i.name for i in case.model.graph.input]
    return case.model.SerializeToString(), [{n: np.asarray(x) for n, x in zip(names, inputs)}
                                            for inputs, _ in case.data_sets]


@pytest.mark.parametrize("name", NODE_CASES)
def test_onnx_node_case(pool, name):
    model, data_sets = _node_case(name)
    assert data_sets
    for feeds in data_sets:
        with _matches(pool, model, feeds):
            pass


def test_scan_of_opset_8_with_shorter_sequences_is_refused_naming_them(pool):
    """Opset 8's Scan runs over whole sequences; a sequence_lens entry shorter than the scan
    inputs is an error naming it (onnxruntime pads such outputs)."""
    model, [feeds] = _node_case("test_scan_sum")
    import onnx

    proto = onnx.load_from_string(model)
    proto.graph.node[0].input[0] = "lens"
    proto.graph.input.insert(0, h.make_tensor_value_info("lens", T.INT64, [1]))
    with vkpool.Session(proto.SerializeToString(), pool=pool) as session:
        with pytest.raises(ModelError, match=r"sequence_lens\[0\] = 2 is shorter than the scan inputs' 3 steps"):
            session.run(None, {**feeds, "lens": np.array([2], np.int64)})


# -- If -------------------------------------------------------------------------------------------

def _if_model() -> bytes:
    """y = x + w (outer-scope constant) when sum(x) > 0, else x concatenated with itself: the
    branches give different shapes."""
    then = h.make_graph([h.make_node("Add", ["x", "w"], ["t"])], "then", [], [_vi("t", [2, 3])])
    other = h.make_graph([h.make_node("Concat", ["x", "x"], ["e"], axis=1)], "else", [], [_vi("e", [2, 6])])
    return _model([h.make_node("ReduceSum", ["x"], ["s"], keepdims=0), h.make_node("Greater", ["s", "zero"], ["c"]),
                   h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                  [_vi("x", [2, 3])], [_vi("y", [2, None])],
                  [nh.from_array(np.array(0, np.float32), "zero"),
                   nh.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")])


def test_if_branches_of_different_shapes_read_outer_values(pool):
    model = _if_model()
    session = _matches(pool, model, {"x": np.ones((2, 3), np.float32)})
    try:
        assert session.run(None, {"x": -np.ones((2, 3), np.float32)})[0].shape == (2, 6)
        assert session.dynamic.counters.suffix_compiles == 2  # one per branch taken
        session.run(None, {"x": np.full((2, 3), 2.0, np.float32)})
        assert session.dynamic.counters.suffix_reuses == 1
    finally:
        session.close()


def test_if_whose_condition_is_known_at_load_is_replaced_by_its_branch(pool):
    then = h.make_graph([h.make_node("Neg", ["x"], ["t"])], "then", [], [_vi("t", [4])])
    other = h.make_graph([h.make_node("Abs", ["x"], ["e"])], "else", [], [_vi("e", [4])])
    model = _model([h.make_node("Shape", ["x"], ["s"]), h.make_node("ReduceSum", ["s"], ["n"], keepdims=0),
                    h.make_node("Equal", ["n", "four"], ["c"]),
                    h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                   [_vi("x", [4])], [_vi("y", [4])], [nh.from_array(np.array(4, np.int64), "four")])
    with _matches(pool, model, {"x": np.array([1, -2, 3, -4], np.float32)}) as session:
        assert session.dynamic is None and [n.op_type for n in session.model.nodes] == ["Neg"]


def test_if_branches_that_return_their_own_constant_or_an_outer_value(pool):
    then = h.make_graph([h.make_node("Identity", ["x"], ["t"])], "then", [], [_vi("t", [3])])
    other = h.make_graph([], "else", [], [_vi("k", [3])], [nh.from_array(np.array([7, 8, 9], np.float32), "k")])
    model = _model([h.make_node("ReduceMax", ["x"], ["m"], keepdims=0), h.make_node("Greater", ["m", "zero"], ["c"]),
                    h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
                    h.make_node("Mul", ["y", "x"], ["z"])],
                   [_vi("x", [3])], [_vi("z", [3])], [nh.from_array(np.array(0, np.float32), "zero")])
    for x in ([1, 2, 3], [-1, -2, -3]):
        with _matches(pool, model, {"x": np.array(x, np.float32)}):
            pass


# -- Loop -----------------------------------------------------------------------------------------

def _loop_model() -> bytes:
    """acc += w each iteration, then doubled on even iterations and reduced by w on odd ones (an If
    nested in the body); the loop stops after M iterations or once sum(acc) reaches ``limit`` (a
    condition the body computes); each iteration's acc * i is a scan output."""
    double = h.make_graph([h.make_node("Mul", ["acc", "two"], ["d"])], "double", [], [_vi("d", [2, 3])])
    minus = h.make_graph([h.make_node("Sub", ["acc", "w"], ["m"])], "minus", [], [_vi("m", [2, 3])])
    body = h.make_graph([
        h.make_node("Add", ["acc_in", "w"], ["acc"]),
        h.make_node("Cast", ["i"], ["fi"], to=T.FLOAT),
        h.make_node("Mod", ["i", "two_i"], ["odd"]),
        h.make_node("Equal", ["odd", "zero_i"], ["even"]),
        h.make_node("If", ["even"], ["acc2"], then_branch=double, else_branch=minus),
        h.make_node("ReduceSum", ["acc2"], ["total"], keepdims=0),
        h.make_node("Less", ["total", "limit"], ["cond_out"]),
        h.make_node("Mul", ["acc2", "fi"], ["scan"]),
    ], "body", [_vi("i", [], T.INT64), _vi("cond_in", [], T.BOOL), _vi("acc_in", [2, 3])],
        [_vi("cond_out", [], T.BOOL), _vi("acc2", [2, 3]), _vi("scan", [2, 3])],
        [nh.from_array(np.array(2, np.float32), "two"), nh.from_array(np.array(2, np.int64), "two_i"),
         nh.from_array(np.array(0, np.int64), "zero_i")])
    return _model([h.make_node("Loop", ["M", "", "x"], ["final", "scans"], body=body)],
                  [_vi("x", [2, 3]), _vi("M", [], T.INT64), _vi("limit", [])],
                  [_vi("final", [2, 3]), _vi("scans", [None, 2, 3])],
                  [nh.from_array(np.full((2, 3), 0.5, np.float32), "w")])


@pytest.mark.parametrize("trip, limit, iterations", [(10, 100.0, 7), (3, 1e9, 3), (0, 1e9, 0)])
def test_loop_with_a_condition_from_its_body_and_a_nested_if(pool, trip, limit, iterations):
    feeds = {"x": np.ones((2, 3), np.float32), "M": np.array(trip, np.int64), "limit": np.array(limit, np.float32)}
    with _matches(pool, _loop_model(), feeds) as session:
        assert session.run(None, feeds)[1].shape == (iterations, 2, 3)
        # one body for the one set of shapes (compiled for its shapes alone where no iteration runs),
        # replayed per iteration: its kernels run on the device
        assert len(session.dynamic.bodies()) == 1 and kernel_nodes(session) > 0


def test_a_loop_that_never_stops_fails_at_the_iteration_limit(pool, monkeypatch):
    """A condition that stays true (and a trip count past the limit): a ModelError naming the Loop
    at vkpool.control_flow.LOOP_ITERATION_LIMIT iterations, not a caller held forever."""
    import vkpool.control_flow
    from vkpool.model import ModelError

    monkeypatch.setattr(vkpool.control_flow, "LOOP_ITERATION_LIMIT", 40)
    feeds = {"x": np.ones((2, 3), np.float32), "M": np.array(10**12, np.int64), "limit": np.array(1e30, np.float32)}
    with vkpool.Session(_loop_model(), pool=pool, device=pool.vulkan_members[0].id) as session:
        with pytest.raises(ModelError, match="ran 40 iterations without stopping"):
            session.run(None, feeds)
        feeds["M"] = np.array(5, np.int64)  # the session serves the next request
        assert session.run(None, feeds)[1].shape == (5, 2, 3)


def test_loop_carried_values_that_grow_compile_the_body_per_shape(pool):
    body = h.make_graph([h.make_node("Concat", ["seq_in", "one"], ["seq"], axis=0),
                         h.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
                        [_vi("i", [], T.INT64), _vi("cond_in", [], T.BOOL), _vi("seq_in", [None])],
                        [_vi("cond_out", [], T.BOOL), _vi("seq", [None])])
    model = _model([h.make_node("Loop", ["M", "go", "x"], ["grown"], body=body)],
                   [_vi("x", [2]), _vi("M", [], T.INT64), _vi("go", [], T.BOOL)], [_vi("grown", [None])],
                   [nh.from_array(np.array([1.5], np.float32), "one")])
    feeds = {"x": np.array([3, 4], np.float32), "M": np.array(4, np.int64), "go": np.array(True)}
    with _matches(pool, model, feeds) as session:
        assert session.run(None, feeds)[0].shape == (6,)
        assert len(session.dynamic.bodies()) == 4  # carried lengths 2, 3, 4 and 5


def test_a_loop_body_slicing_at_its_iteration_number_is_cut_again_per_iteration(pool):
    """Slice's starts come from the iteration number: the body is a cut model of its own, its
    part after the Slice compiled per value of i."""
    body = h.make_graph([h.make_node("Unsqueeze", ["i", "axis0"], ["start"]),
                         h.make_node("Add", ["start", "one"], ["end"]),
                         h.make_node("Slice", ["x", "start", "end", "axis0"], ["row"]),
                         h.make_node("Add", ["acc_in", "row"], ["acc"]),
                         h.make_node("Identity", ["cond_in"], ["cond_out"])], "body",
                        [_vi("i", [], T.INT64), _vi("cond_in", [], T.BOOL), _vi("acc_in", [1, 4])],
                        [_vi("cond_out", [], T.BOOL), _vi("acc", [1, 4]), _vi("row", [1, 4])],
                        [nh.from_array(np.array([0], np.int64), "axis0"), nh.from_array(np.array([1], np.int64), "one")])
    model = _model([h.make_node("Loop", ["M", "", "acc0"], ["total", "rows"], body=body)],
                   [_vi("x", [3, 4]), _vi("M", [], T.INT64), _vi("acc0", [1, 4])],
                   [_vi("total", [1, 4]), _vi("rows", [None, 1, 4])])
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "M": np.array(3, np.int64),
             "acc0": np.ones((1, 4), np.float32)}
    with _matches(pool, model, feeds):
        pass


def test_a_loop_body_reading_the_outer_value_it_also_starts_from(pool):
    """x is both the Loop's initial value and an outer value its body reads: a = a_in + x."""
    body = h.make_graph([h.make_node("Add", ["a_in", "x"], ["a"]), h.make_node("Identity", ["c_in"], ["c"])],
                        "body", [_vi("i", [], T.INT64), _vi("c_in", [], T.BOOL), _vi("a_in", [2, 3])],
                        [_vi("c", [], T.BOOL), _vi("a", [2, 3])])
    model = _model([h.make_node("Loop", ["n", "", "x"], ["y"], body=body)], [_vi("x", [2, 3]), _vi("n", [], T.INT64)],
                   [_vi("y", [2, 3])])
    with _matches(pool, model, {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.array(3, np.int64)}):
        pass


# -- Scan -----------------------------------------------------------------------------------------

def _scan_model() -> bytes:
    body = h.make_graph([h.make_node("Add", ["s_in", "xi"], ["s_out"]), h.make_node("Mul", ["s_out", "k"], ["y"])],
                        "body", [_vi("s_in", [2]), _vi("xi", [2])], [_vi("s_out", [2]), _vi("y", [2])])
    model = _model([h.make_node("Scan", ["s0", "xs"], ["sf", "ys"], body=body, num_scan_inputs=1,
                                scan_input_axes=[1], scan_input_directions=[1], scan_output_axes=[1],
                                scan_output_directions=[1])],
                   [_vi("s0", [2]), _vi("xs", [2, "T"]), _vi("k", [2])], [_vi("sf", [2]), _vi("ys", [2, "T"])])
    return model


def test_scan_in_reverse_along_axis_1_with_reversed_outputs(pool):
    rng = np.random.default_rng(0)
    feeds = {"s0": rng.random(2, dtype=np.float32), "xs": rng.random((2, 5), dtype=np.float32),
             "k": rng.random(2, dtype=np.float32)}
    with _matches(pool, _scan_model(), feeds):
        pass


def test_a_scan_of_no_step_keeps_its_state_and_gives_empty_outputs(pool):
    """Solved by hand (onnxruntime 1.23 dies of a floating point exception on this one): no step
    leaves the state as it came, and the scan output has 0 steps along its axis."""
    s0 = np.array([0.25, -1.5], np.float32)
    with vkpool.Session(_scan_model(), pool=pool) as session:
        final, ys = session.run(None, {"s0": s0, "xs": np.zeros((2, 0), np.float32), "k": np.ones(2, np.float32)})
    np.testing.assert_array_equal(final, s0)
    assert ys.shape == (2, 0) and ys.dtype == np.float32


# -- NonMaxSuppression ----------------------------------------------------------------------------

def test_nms_of_computed_boxes_feeds_a_gather_on_the_device(pool):
    """Boxes computed on the device, suppressed on the host, the selected boxes gathered by the part
    of the model after the cut (compiled per count of selected boxes)."""
    model = _model([h.make_node("Relu", ["b"], ["boxes"]),
                    h.make_node("NonMaxSuppression", ["boxes", "s", "most", "iou", "least"], ["sel"],
                                center_point_box=1),
                    h.make_node("Gather", ["boxes", "sel"], ["picked"], axis=1)],
                   [_vi("b", [2, 50, 4]), _vi("s", [2, 3, 50])],
                   [_vi("sel", [None, 3], T.INT64), _vi("picked", [2, None, 3, 4])],
                   [nh.from_array(np.array([5], np.int64), "most"), nh.from_array(np.array([0.3], np.float32), "iou"),
                    nh.from_array(np.array([0.2], np.float32), "least")])
    rng = np.random.default_rng(1)
    boxes = rng.random((2, 50, 4), dtype=np.float32)
    boxes[..., 2:] *= 0.5
    with _matches(pool, model, {"b": boxes, "s": rng.random((2, 3, 50), dtype=np.float32)}) as session:
        assert session.run(None, {"b": boxes, "s": rng.random((2, 3, 50), dtype=np.float32)})[0].shape[1] == 3


# -- refusals at load -----------------------------------------------------------------------------

def test_an_op_without_kernel_inside_a_loop_body_is_refused_at_load(pool):
    body = h.make_graph([h.make_node("Unique", ["v_in"], ["v"]), h.make_node("Identity", ["cond_in"], ["cond_out"])],
                        "body", [_vi("i", [], T.INT64), _vi("cond_in", [], T.BOOL), _vi("v_in", [3])],
                        [_vi("cond_out", [], T.BOOL), _vi("v", [None])])
    model = _model([h.make_node("Loop", ["M", "go", "x"], ["y"], body=body)],
                   [_vi("x", [3]), _vi("M", [], T.INT64), _vi("go", [], T.BOOL)], [_vi("y", [None])])
    with pytest.raises(UnsupportedOp, match="does not support: Unique"):
        vkpool.Session(model, pool=pool)


def test_a_loop_that_runs_no_iteration_with_unknowable_scan_shapes_says_so(pool):
    """A scan output whose per-iteration shape depends on a value the body computes cannot be given
    a shape without an iteration: an error naming the Loop and the output, not a guess."""
    body = h.make_graph([h.make_node("Identity", ["cond_in"], ["cond_out"]),
                         h.make_node("Range", ["zero", "n", "one"], ["r"])], "body",
                        [_vi("i", [], T.INT64), _vi("cond_in", [], T.BOOL)],
                        [_vi("cond_out", [], T.BOOL), _vi("r", [None], T.INT64)],
                        [nh.from_array(np.array(0, np.int64), "zero"), nh.from_array(np.array(1, np.int64), "one")])
    model = _model([h.make_node("Loop", ["M", "go"], ["rs"], body=body, name="counting")],
                   [_vi("n", [], T.INT64), _vi("M", [], T.INT64), _vi("go", [], T.BOOL)],
                   [_vi("rs", [None, None], T.INT64)])
    feeds = {"n": np.array(3, np.int64), "M": np.array(2, np.int64), "go": np.array(True)}
    with _matches(pool, model, feeds) as session:
        with pytest.raises(ModelError, match="Loop 'counting' ran no iteration"):
            session.run(None, {**feeds, "M": np.array(0, np.int64)})

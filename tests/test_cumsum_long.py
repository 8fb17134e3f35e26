"""Long serial loops on the device against onnxruntime on the CPU (float32 rtol 1e-4).
CumSum, TopK, Einsum, NonZero and the direct Conv run past the limit in pieces; the kernels that
cannot split are refused at load.

lavapipe ends every loop of a shader invocation once all of them together have run 65,535
iterations (Mesa's LP_MAX_TGSI_LOOP_ITERATIONS), without an error: a CumSum along 131,072
elements wrote zeros from element 65,534 on. The kernels split such work into pieces within the
device's ``max_loop_iterations``, or refuse it at load; these cases run the pieces at the real
limit (axes past 65,535) and at a lowered one (VKPOOL_DEVICE_LIMITS), where small tensors cross
several piece boundaries.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import helper, numpy_helper

import vkpool
from conftest import vulkan_pool
from node_cases import assert_outputs_match, ort_case as one_node
from vkpool.kernels.base import DeviceCaps, UnsupportedOp, check_serial, serial_pieces

ort = pytest.importorskip("onnxruntime", reason="onnxruntime computes the expected outputs")
RNG = np.random.default_rng(11)




def run_and_compare(pool: Any, case: tuple[bytes, dict[str, np.ndarray], list[np.ndarray]]) -> None:
    model, feeds, expected = case
    with vkpool.Session(model, pool=pool, device=pool.vulkan_members[0].id) as session:
        assert_outputs_match(session.run(None, feeds), expected)


def test_pieces_cover_the_steps_within_the_limit():
    caps = DeviceCaps(max_loop_iterations=1000)
    for n, cost in [(1, 1), (936, 1), (937, 1), (5000, 1), (5000, 7), (70000, 3)]:
        pieces = serial_pieces(n, cost, caps, "case")
        assert pieces[0][0] == 0 and sum(c for _, c in pieces) == n
        assert all(s + c == s2 for (s, c), (s2, _) in zip(pieces, pieces[1:]))
        assert all(c * cost <= 1000 for _, c in pieces)
    assert serial_pieces(10 ** 9, 5, DeviceCaps(), "case") == [(0, 10 ** 9)]
    with pytest.raises(UnsupportedOp, match="limit of 1000"):
        serial_pieces(3, 2000, caps, "case")
    with pytest.raises(UnsupportedOp, match="case: 5000 loop iterations"):
        check_serial(5000, caps, "case")


def test_lavapipe_reports_its_loop_limit(pool):
    member = pool.vulkan_members[0]
    if "llvmpipe" not in member.device.info.name:
        pytest.skip(f"the loop limit is lavapipe's; this device is {member.device.info.name}")
    assert member.device.caps.max_loop_iterations == 65535


@pytest.mark.parametrize("shape,axis", [((131072,), 0), ((2, 70000), 1), ((70000, 2), 0)])
def test_cumsum_along_an_axis_past_the_loop_limit(pool, shape, axis):
    x = RNG.standard_normal(shape).astype(np.float32)
    run_and_compare(pool, one_node("CumSum", [x, np.array(axis, np.int64)], constants=(1,)))


def test_cumsum_long_axis_exclusive_reverse_int(pool):
    x = RNG.integers(-5, 5, (70000,)).astype(np.int64)
    run_and_compare(pool, one_node("CumSum", [x, np.array(0, np.int32)], {"exclusive": 1, "reverse": 1}))


@pytest.fixture(scope="module")
def low_loop_pool():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VKPOOL_DEVICE_LIMITS", "max_loop_iterations=300")
        p = vulkan_pool()
    yield p
    p.close()


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum_pieces_at_a_lowered_limit(low_loop_pool, exclusive, reverse):
    assert low_loop_pool.vulkan_members[0].device.caps.max_loop_iterations == 300
    x = RNG.standard_normal((3, 1000, 2)).astype(np.float32)
    run_and_compare(low_loop_pool, one_node("CumSum", [x, np.array(1, np.int64)],
                                            {"exclusive": exclusive, "reverse": reverse}, constants=(1,)))


@pytest.mark.parametrize("axis", [-2, 1])
def test_cumsum_run_time_axis_at_a_lowered_limit(low_loop_pool, axis):
    """The axis is fed at run time: pieces cover the longest dim, and along the short one every
    piece past its extent does nothing."""
    x = RNG.standard_normal((700, 3)).astype(np.float32)
    run_and_compare(low_loop_pool, one_node("CumSum", [x, np.array(axis, np.int64)]))


def test_topk_along_a_line_past_the_loop_limit(pool):
    x = RNG.standard_normal(100000).astype(np.float32)
    run_and_compare(pool, one_node("TopK", [x, np.array([5], np.int64)], constants=(1,), outputs=2))


def test_einsum_sum_past_the_loop_limit(pool):
    # small whole numbers sum exactly in float32 in any order: every element must be counted once
    x = RNG.integers(-3, 4, (300, 300)).astype(np.float32)
    run_and_compare(pool, one_node("Einsum", [x], {"equation": "ij->"}, opset=12))


@pytest.mark.parametrize("largest", [0, 1])
def test_topk_pieces_at_a_lowered_limit(low_loop_pool, largest):
    x = RNG.integers(-20, 20, (3, 2000)).astype(np.float32)  # ties: the lower index first
    run_and_compare(low_loop_pool, one_node("TopK", [x, np.array([7], np.int64)], {"largest": largest},
                                            constants=(1,), outputs=2))


def test_einsum_pieces_at_a_lowered_limit(low_loop_pool):
    a, b = RNG.standard_normal((4, 900)).astype(np.float32), RNG.standard_normal((900, 3)).astype(np.float32)
    run_and_compare(low_loop_pool, one_node("Einsum", [a, b], {"equation": "ik,kj->ij"}, opset=12))


def test_nonzero_pieces_at_a_lowered_limit(low_loop_pool):
    x = (RNG.random((40, 50)) < 0.3).astype(np.float32)
    run_and_compare(low_loop_pool, one_node("NonZero", [x], constants=(0,)))


def test_conv_over_channels_past_the_loop_limit(pool):
    """A direct convolution (few output channels) summing 70,000 input channels; small whole
    numbers, so any order of summation is exact."""
    x = RNG.integers(-3, 4, (1, 70000, 1, 2)).astype(np.float32)
    w = RNG.integers(-3, 4, (2, 70000, 1, 1)).astype(np.float32)
    run_and_compare(pool, one_node("Conv", [x, w], constants=(1,)))


def test_conv_pieces_with_bias_and_relu_at_a_lowered_limit(low_loop_pool):
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", 1, [1, 40, 6, 6])], [helper.make_tensor_value_info("y", 1, [1, 3, 6, 6])],
        [numpy_helper.from_array(RNG.standard_normal((3, 40, 3, 3)).astype(np.float32), "w"),
         numpy_helper.from_array(RNG.standard_normal(3).astype(np.float32), "b")]),
        opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    x = RNG.standard_normal((1, 40, 6, 6)).astype(np.float32)
    expected = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    run_and_compare(low_loop_pool, (model.SerializeToString(), {"x": x}, expected))


@pytest.mark.parametrize("op,inputs,attrs", [
    ("Hardmax", [np.zeros((2, 400), np.float32)], {"axis": 1}),
    ("DFT", [np.zeros((1, 400, 1), np.float32)], {"axis": 1}),
    ("AveragePool", [np.zeros((1, 1, 20, 20), np.float32)], {"kernel_shape": [20, 20]}),
])
def test_serial_kernels_past_a_lowered_limit_are_refused(low_loop_pool, op, inputs, attrs):
    model, feeds, _ = one_node(op, inputs, attrs, opset=17)
    with pytest.raises(Exception, match=f"{op}.*loop iterations in one invocation exceed the device's limit of 300"):
        with vkpool.Session(model, pool=low_loop_pool, device=low_loop_pool.vulkan_members[0].id) as session:
            session.run(None, feeds)

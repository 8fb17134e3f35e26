"""Reductions and normalisation layers on the real Vulkan device, against ONNX's reference.

Each case is a one-node model run through ``vkpool.Session``; inputs that must be known at
load time (axes, k) are initializers. Tolerances: float32 rtol 1e-4, atol 1e-5 (reductions
sum in a different order than numpy); integer and bool outputs must match exactly. Shapes are
small except where a case exists to take the workgroup-per-row path (rows >= 64 long).
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

from node_cases import run_node as node_case

RNG = np.random.default_rng(7)


run_node = functools.partial(node_case, opset=23)


def assert_matches(got: list[np.ndarray], expected: list[np.ndarray], rtol: float = 1e-4, atol: float = 1e-5) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, g.dtype, e.shape, e.dtype)
        if e.dtype.kind == "f":
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(g, e)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


REDUCE_OPS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare"]


@pytest.mark.parametrize("op_type", REDUCE_OPS)
@pytest.mark.parametrize("shape,axes,keepdims", [
    ((3, 4, 5), [1], 1),
    ((3, 4, 5), [0, 2], 0),        # non-adjacent axes: no transposition needed
    ((2, 3, 80), [-1], 1),         # long rows: a workgroup per output
    ((2, 3, 4), None, 0),          # all axes
])
def test_reduce(pool, op_type, shape, axes, keepdims):
    x = randn(*shape)
    if op_type in ("ReduceLogSum", "ReduceProd"):
        x = np.abs(x) + np.float32(0.5)  # keep log finite and the product in range
    inputs = [x, None if axes is None else np.array(axes, np.int64)]
    got, want = run_node(pool, op_type, inputs, {"keepdims": keepdims}, constants=(1,), opset=18)
    assert_matches(got, want)


def test_reduce_sum_int64_and_noop(pool):
    x = RNG.integers(-50, 50, (4, 6)).astype(np.int64)
    got, want = run_node(pool, "ReduceSum", [x, np.array([1], np.int64)], constants=(1,), opset=13)
    assert_matches(got, want)
    got, want = run_node(pool, "ReduceSum", [x, None], {"noop_with_empty_axes": 1}, opset=13)
    assert_matches(got, want)


def test_reduce_attribute_axes_before_opset_18(pool):
    x = randn(2, 5, 3)
    got, want = run_node(pool, "ReduceMean", [x], {"axes": [1]}, opset=13)
    assert_matches(got, want)


def test_reduce_max_bool(pool):
    x = RNG.integers(0, 2, (3, 7)).astype(np.bool_)
    got, want = run_node(pool, "ReduceMax", [x, np.array([1], np.int64)], {"keepdims": 0}, constants=(1,), opset=20)
    assert_matches(got, want)


@pytest.mark.parametrize("op_type", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("last", [0, 1])
@pytest.mark.parametrize("n", [5, 130])
def test_argmax_ties(pool, op_type, last, n):
    x = RNG.integers(0, 4, (3, n)).astype(np.float32)  # many ties: select_last_index matters
    got, want = run_node(pool, op_type, [x], {"axis": 1, "keepdims": 0, "select_last_index": last})
    assert_matches(got, want)


@pytest.mark.parametrize("exclusive,reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumsum(pool, exclusive, reverse):
    x = randn(3, 4, 5)
    got, want = run_node(pool, "CumSum", [x, np.array(1, np.int32)], {"exclusive": exclusive, "reverse": reverse})
    assert_matches(got, want)


def test_cumsum_axis_is_a_run_time_input(pool):
    x = RNG.integers(-9, 9, (4, 3)).astype(np.int64)
    got, want = run_node(pool, "CumSum", [x, np.array(-2, np.int64)])
    assert_matches(got, want)


@pytest.mark.parametrize("largest", [0, 1])
def test_topk(pool, largest):
    x = RNG.integers(0, 6, (3, 9, 2)).astype(np.float32)  # ties: lower index first
    got, want = run_node(pool, "TopK", [x, np.array([4], np.int64)], {"axis": 1, "largest": largest},
                         constants=(1,), num_outputs=2)
    assert_matches(got, want)


def test_hardmax(pool):
    x = RNG.integers(0, 3, (3, 4, 2)).astype(np.float32)  # ties: the first maximum wins
    got, want = run_node(pool, "Hardmax", [x], {"axis": 0}, opset=13)
    assert_matches(got, want)


def test_hardmax_before_opset_13_coerces_to_2d(pool):
    # ONNX's reference evaluator applies the opset-13 rule to every opset, so the expected
    # value is written out: rows are x.reshape(3, 8) (axis 1 and everything after it).
    x = RNG.integers(0, 3, (3, 4, 2)).astype(np.float32)
    got, _ = run_node(pool, "Hardmax", [x], {"axis": 1}, opset=11)
    rows = x.reshape(3, 8)
    want = np.zeros_like(rows)
    want[np.arange(3), rows.argmax(axis=1)] = 1
    assert_matches(got, [want.reshape(x.shape)])


@pytest.mark.parametrize("axis,n", [(-1, 6), (1, 100)])
def test_layer_normalization(pool, axis, n):
    x = randn(2, 3, n)
    norm_shape = x.shape[axis:]
    scale, bias = randn(*norm_shape), randn(*norm_shape)
    got, want = run_node(pool, "LayerNormalization", [x, scale, bias], {"axis": axis}, num_outputs=3, opset=17)
    assert_matches(got, want)


def test_layer_normalization_broadcast_scale_no_bias(pool):
    x = randn(2, 3, 4)
    got, want = run_node(pool, "LayerNormalization", [x, randn(4)], {"axis": 1}, opset=17)
    assert_matches(got, want)


def test_rms_normalization(pool):
    x = randn(2, 3, 8)
    got, want = run_node(pool, "RMSNormalization", [x, randn(8)], {"epsilon": 1e-3})
    assert_matches(got, want)


def test_group_normalization(pool):
    # opset 21 form (scale/bias per channel); the checker refuses opset 18's deprecated form
    x = randn(2, 6, 3, 3)
    got, want = run_node(pool, "GroupNormalization", [x, randn(6), randn(6)], {"num_groups": 3}, opset=21)
    assert_matches(got, want)


def test_instance_normalization(pool):
    x = randn(2, 3, 4, 5)
    got, want = run_node(pool, "InstanceNormalization", [x, randn(3), randn(3)])
    assert_matches(got, want)


def test_mean_variance_normalization(pool):
    x = randn(2, 3, 4, 5)
    got, want = run_node(pool, "MeanVarianceNormalization", [x], {"axes": [0, 2, 3]}, opset=13)
    assert_matches(got, want)


@pytest.mark.parametrize("p", [1, 2])
def test_lp_normalization(pool, p):
    x = randn(3, 4, 5)
    x[1, :, 2] = 0  # a zero norm gives zeros
    got, _ = run_node(pool, "LpNormalization", [x], {"axis": 1, "p": p})
    # written out: ONNX's reference sums x**p, which for p=1 is not the L1 norm of signed data
    norm = np.abs(x).sum(axis=1, keepdims=True) if p == 1 else np.sqrt((x * x).sum(axis=1, keepdims=True))
    want = np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm)).astype(np.float32)
    assert_matches(got, [want])

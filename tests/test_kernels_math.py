"""Trigonometric, hyperbolic, bitwise and cumulative-product kernels on the real Vulkan device,
against ONNX's reference evaluator. Float32 tolerances: rtol 1e-4, atol 1e-6 (the onnx backend tests ask
for rtol 1e-3, atol 1e-7); integer outputs must match exactly."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from node_cases import run_node

RNG = np.random.default_rng(4321)


@pytest.mark.parametrize("op,low,high", [
    ("Tan", -1.4, 1.4), ("Asin", -1, 1), ("Acos", -1, 1), ("Atan", -20, 20), ("Sinh", -8, 8),
    ("Cosh", -8, 8), ("Asinh", -50, 50), ("Acosh", 1, 50), ("Atanh", -0.99, 0.99),
])
def test_trigonometric(pool, op, low, high):
    x = RNG.uniform(low, high, size=(4, 33)).astype(np.float32)
    got, expected = run_node(pool, op, [x])
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("op", ["Sinh", "Asinh", "Atanh"])
def test_odd_functions_keep_relative_precision_near_zero(pool, op):
    # the textbook formulas (e^x - e^-x)/2, log(x + sqrt(x^2 + 1)), log((1 + x)/(1 - x))/2 cancel here
    x = np.array([1e-7, -3e-6, 2e-4, -0.01, 0.05], np.float32)
    got, expected = run_node(pool, op, [x])
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=0)


# each dtype is a shader variant to compile: a few cover the narrow, 32- and 64-bit paths
@pytest.mark.parametrize("dtype", [np.uint8, np.uint64, np.int8, np.int32])
@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bitshift(pool, dtype, direction):
    bits = np.dtype(dtype).itemsize * 8
    low = -bits if np.dtype(dtype).kind == "i" else 0
    x = RNG.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, size=(3, 16), dtype=dtype, endpoint=True)
    # counts past the width and (signed) negative ones: every bit is shifted out
    y = RNG.integers(low, bits + 4, size=(16,)).astype(dtype)
    got, expected = run_node(pool, "BitShift", [x, y], {"direction": direction},
                             opset=onnx.defs.onnx_opset_version())
    np.testing.assert_array_equal(got[0], expected[0])


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
@pytest.mark.parametrize("dtype", [np.int8, np.uint64])
def test_bitwise_binary(pool, op, dtype):
    info = np.iinfo(dtype)
    a = RNG.integers(info.min, info.max, size=(2, 3, 5), dtype=dtype, endpoint=True)
    b = RNG.integers(info.min, info.max, size=(3, 1), dtype=dtype, endpoint=True)
    got, expected = run_node(pool, op, [a, b], opset=18)
    np.testing.assert_array_equal(got[0], expected[0])


@pytest.mark.parametrize("dtype", [np.int8, np.uint32])
def test_bitwise_not(pool, dtype):
    info = np.iinfo(dtype)
    x = RNG.integers(info.min, info.max, size=(7, 9), dtype=dtype, endpoint=True)
    got, expected = run_node(pool, "BitwiseNot", [x], opset=18)
    np.testing.assert_array_equal(got[0], expected[0])


@pytest.mark.parametrize("dtype,exclusive,reverse", [
    (np.float32, 0, 0), (np.float32, 1, 0), (np.float32, 0, 1), (np.float32, 1, 1), (np.int64, 1, 1),
])
def test_cumprod(pool, dtype, exclusive, reverse):
    x = RNG.uniform(0.5, 1.5, size=(3, 6, 4)).astype(dtype) if dtype == np.float32 else \
        RNG.integers(-3, 4, size=(3, 6, 4)).astype(dtype)
    axis = np.array(-2, np.int64)
    got, expected = run_node(pool, "CumProd", [x, axis], {"exclusive": exclusive, "reverse": reverse},
                             opset=26)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)

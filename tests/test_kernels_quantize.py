"""QuantizeLinear, DequantizeLinear and DynamicQuantizeLinear on the real Vulkan device, against
ONNX's reference evaluator: per-tensor, per-axis and blocked scales, 8-/16-bit and narrow
quantized types. Quantized values must match exactly (ties round to even); dequantized ones to
rtol 1e-6."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import helper

from node_cases import run_node

RNG = np.random.default_rng(99)
X = (RNG.standard_normal((2, 6, 4)) * 40).astype(np.float32)
X.reshape(-1)[:8] = [0.5, 1.5, 2.5, -0.5, -2.5, 1000.0, -1000.0, 0.0]  # ties and saturation


def params(kind: str, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, dict[str, int]]:
    """Scale, zero point and attributes of a per-tensor, per-axis (axis 1) or blocked layout."""
    shape = {"tensor": (), "axis": (6,), "blocked": (2, 3, 4)}[kind]
    scale = RNG.uniform(0.5, 2.0, size=shape).astype(np.float32)
    if kind == "tensor":
        scale = np.array(1.0, np.float32)  # exact halves stay ties
    info = ml_dtypes.iinfo(dtype) if dtype.kind in "iu" or "int" in dtype.name else None
    zero = (RNG.integers(int(info.min) // 2, int(info.max) // 2 + 1, size=shape) if info else
            np.zeros(shape)).astype(dtype)
    attrs = {"axis": 1} | ({"block_size": 2} if kind == "blocked" else {})
    return scale, zero, attrs


# each type is a shader variant per op to compile: one of each family (8-, 16-bit, narrow, float8)
TYPES = [np.uint8, np.int16, ml_dtypes.int4, ml_dtypes.float8_e4m3fn]


@pytest.mark.parametrize("dtype", TYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("kind", ["tensor", "axis", "blocked"])
def test_quantize_and_dequantize(pool, dtype, kind):
    dtype = np.dtype(dtype)
    scale, zero, attrs = params(kind, dtype)
    got, expected = run_node(pool, "QuantizeLinear", [X, scale, zero], attrs, opset=24)
    assert got[0].dtype == dtype
    np.testing.assert_array_equal(got[0].view(np.uint8) if dtype.itemsize == 1 else got[0],
                                  expected[0].view(np.uint8) if dtype.itemsize == 1 else expected[0])
    got, expected = run_node(pool, "DequantizeLinear", [expected[0], scale, zero], attrs, opset=24)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)


def test_quantize_without_zero_point_to_output_dtype(pool):
    scale = np.array(0.25, np.float32)
    attrs = {"output_dtype": helper.np_dtype_to_tensor_dtype(np.dtype(np.int8))}
    got, expected = run_node(pool, "QuantizeLinear", [X, scale], attrs, opset=24)
    assert got[0].dtype == np.int8
    np.testing.assert_array_equal(got[0], expected[0])


@pytest.mark.parametrize("low,high", [(-3.0, 5.0), (0.5, 7.0), (-4.0, -1.0)])
def test_dynamic_quantize(pool, low, high):
    x = RNG.uniform(low, high, size=(3, 70)).astype(np.float32)
    got, expected = run_node(pool, "DynamicQuantizeLinear", [x], num_outputs=3, opset=11)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-6)
    np.testing.assert_array_equal(got[2], expected[2])
    np.testing.assert_array_equal(got[0], expected[0])


def test_quotients_next_to_a_tie_round_as_ieee_division_does(pool):
    """x / scale within an ulp of k + 0.5, where a division a few ulp off (as Vulkan allows) would
    round to the other step: every value lands where numpy's correctly rounded division puts it,
    for QuantizeLinear and for DynamicQuantizeLinear (whose scale is computed on the device too)."""
    scale = np.float32(0.0156862754)
    ties = np.array([(k + 0.5) * scale for k in range(-60, 60)], np.float32)
    x = np.concatenate([ties, np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf)),
                        np.array([-2.0, 2.0], np.float32)]).reshape(1, -1)
    zero = np.array(0, np.int8)
    got, _ = run_node(pool, "QuantizeLinear", [x, scale, zero], opset=21)
    exact = np.clip(np.rint(x / scale), -128, 127).astype(np.int8)
    np.testing.assert_array_equal(got[0], exact)
    got, expected = run_node(pool, "DynamicQuantizeLinear", [x], num_outputs=3, opset=11)
    assert got[1] == expected[1]  # the scale itself: (max - min) / 255, rounded as IEEE rounds it
    np.testing.assert_array_equal(got[0], expected[0])

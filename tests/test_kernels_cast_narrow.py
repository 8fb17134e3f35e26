"""Cast between float8, float4, 4-/2-bit integers, bfloat16 and the wider types on the real
Vulkan device, compared with ml_dtypes' own conversions (as the ONNX backend tests generate
their data): every bit pattern of each narrow type decoded, and ties, overflow and subnormal
edges encoded, with and without saturation. Results are exact; NaN matches any NaN."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import helper

from node_cases import run_node

NARROW = ["float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
          "float4_e2m1fn", "int4", "uint4", "int2", "uint2"]


def every_value(name: str) -> np.ndarray:
    dtype = np.dtype(getattr(ml_dtypes, name))
    bits = 8 if name.startswith("float8") else int(name[-1]) if "int" in name else 4
    # ml_dtypes keeps a narrow value in the low bits of its byte
    return np.arange(2 ** bits, dtype=np.uint8).view(dtype).reshape(1, -1)


# each (type, target) pair is a shader variant to compile: every type to float32, one to float16
@pytest.mark.parametrize("name,target", [(n, np.float32) for n in NARROW] + [("float8_e4m3fn", np.float16)])
def test_cast_from_narrow_to_float(pool, name, target):
    x = every_value(name)
    with np.errstate(over="ignore"):  # e8m0's largest values are inf in float16
        want = x.astype(np.float32).astype(target)
    got, _ = run_node(pool, "Cast", [x], {"to": helper.np_dtype_to_tensor_dtype(np.dtype(target))},
                      opset=25, expected=[want])
    np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("name,target", [("int4", np.int8), ("uint2", np.uint8)])
def test_cast_from_narrow_integer_to_byte(pool, name, target):
    x = every_value(name)
    want = x.astype(target)
    got, _ = run_node(pool, "Cast", [x], {"to": helper.np_dtype_to_tensor_dtype(np.dtype(target))},
                      opset=25, expected=[want])
    np.testing.assert_array_equal(got[0], want)


def edge_values() -> np.ndarray:
    """Ties, overflow and subnormal boundaries of every narrow float, signed zeros, inf and NaN."""
    steps = np.array([0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 6.0, 7.0, 448.0, 464.0, 465.0,
                      480.0, 240.0, 248.0, 57344.0, 61440.0, 61441.0, 1e6, 2.0 ** -9, 2.0 ** -10,
                      3 * 2.0 ** -11, 2.0 ** -16, 2.0 ** -17, 3 * 2.0 ** -18, 1e-7, np.inf], np.float32)
    values = np.concatenate([steps, -steps, RNG_VALUES, [np.nan]]).astype(np.float32)
    return values.reshape(1, -1)


RNG_VALUES = np.random.default_rng(5).standard_normal(64).astype(np.float32) * 30


@pytest.mark.parametrize("name,saturate,source", [
    ("float8_e4m3fn", 1, np.float32), ("float8_e4m3fn", 0, np.float32), ("float8_e4m3fn", 1, np.float16),
    ("float8_e4m3fnuz", 0, np.float32), ("float8_e5m2", 1, np.float32), ("float8_e5m2", 0, np.float32),
    ("float8_e5m2fnuz", 1, np.float32), ("float4_e2m1fn", 1, np.float32),
])
def test_cast_float_to_narrow_float(pool, name, saturate, source):
    dtype = np.dtype(getattr(ml_dtypes, name))
    with np.errstate(over="ignore"):  # 1e6 and 61441 are inf in float16: an edge case as well
        x = edge_values().astype(source)
    wide = x.astype(np.float32)
    if saturate and name != "float4_e2m1fn":
        info = ml_dtypes.finfo(dtype)
        wide = np.clip(wide, float(info.min), float(info.max))
    want = wide.astype(dtype)
    got, _ = run_node(pool, "Cast", [x], {"to": helper.np_dtype_to_tensor_dtype(dtype), "saturate": saturate},
                      opset=25, expected=[want])
    # compare bits: NaN has several encodings, every other value exactly one
    g, w = got[0].astype(np.float32), want.astype(np.float32)
    assert ((g == w) | (np.isnan(g) & np.isnan(w))).all(), (x[g != w], g[g != w], w[g != w])
    assert (np.signbit(g) == np.signbit(w))[~np.isnan(w)].all()


@pytest.mark.parametrize("name", ["int4", "uint2"])
def test_cast_float_to_narrow_integer(pool, name):
    dtype = np.dtype(getattr(ml_dtypes, name))
    x = np.arange(-20, 20, 0.75, dtype=np.float32).reshape(1, -1)
    want = x.astype(dtype)
    got, _ = run_node(pool, "Cast", [x], {"to": helper.np_dtype_to_tensor_dtype(dtype)}, opset=25,
                      expected=[want])
    np.testing.assert_array_equal(got[0].view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("source", [np.float32])
def test_cast_bfloat16_both_ways(pool, source):
    bf16 = np.dtype(ml_dtypes.bfloat16)
    # ties to even in the dropped half, the largest finite values rounding to inf, NaN, zeros
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0xFF7F8000, 0x00000001, 0x80000000,
                     0x7FC00000, 0x7F800000], np.uint32).view(np.float32)
    with np.errstate(over="ignore"):
        x = np.concatenate([bits, edge_values()[0]]).astype(source).reshape(1, -1)
    want = x.astype(bf16)
    got, _ = run_node(pool, "Cast", [x], {"to": helper.np_dtype_to_tensor_dtype(bf16)}, opset=25,
                      expected=[want])
    g, w = got[0].astype(np.float32), want.astype(np.float32)
    assert ((g == w) | (np.isnan(g) & np.isnan(w))).all(), (x[g != w], g[g != w], w[g != w])
    back, _ = run_node(pool, "Cast", [want], {"to": helper.np_dtype_to_tensor_dtype(np.dtype(source))},
                       opset=25, expected=[want.astype(source)])
    np.testing.assert_array_equal(back[0], want.astype(source))

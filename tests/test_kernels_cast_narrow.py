"""Cast from float8, float4 and 4-/2-bit integers on the real Vulkan device: every bit pattern of
each type, compared with ml_dtypes' own conversion (NaN where it gives NaN, else exact)."""
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


@pytest.mark.parametrize("name", NARROW)
@pytest.mark.parametrize("target", [np.float32, np.float16])
def test_cast_from_narrow_to_float(pool, name, target):
    x = every_value(name)
    want = x.astype(np.float32).astype(target)
    got, _ = run_node(pool, "Cast", [x], {"to": helper.np_dtype_to_tensor_dtype(np.dtype(target))},
                      opset=25, expected=[want])
    np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("name,target", [("int4", np.int8), ("uint4", np.uint8), ("int2", np.int8),
                                         ("uint2", np.uint8)])
def test_cast_from_narrow_integer_to_byte(pool, name, target):
    x = every_value(name)
    want = x.astype(target)
    got, _ = run_node(pool, "Cast", [x], {"to": helper.np_dtype_to_tensor_dtype(np.dtype(target))},
                      opset=25, expected=[want])
    np.testing.assert_array_equal(got[0], want)

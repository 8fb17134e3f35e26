"""MatMulInteger and QLinearMatMul on the real Vulkan device, against ONNX's reference evaluator:
uint8 and int8, 2-D and batched (shared or per-batch right operand), float32 and float16
scales; exact integer results."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node

RNG = np.random.default_rng(31)


def ints(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    info = np.iinfo(dtype)
    return RNG.integers(info.min, info.max, size=shape, endpoint=True).astype(dtype)


@pytest.mark.parametrize("dtype,a_shape,b_shape", [
    (np.uint8, (5, 7), (7, 3)), (np.int8, (2, 5, 7), (2, 7, 3)), (np.uint8, (2, 4, 6), (6, 5)),
])
def test_matmul_integer(pool, dtype, a_shape, b_shape):
    a, b = ints(a_shape, dtype), ints(b_shape, dtype)
    zeros = [np.array([3], dtype), np.array([250 if dtype == np.uint8 else -7], dtype)]
    got, expected = run_node(pool, "MatMulInteger", [a, b, *zeros], opset=10)
    np.testing.assert_array_equal(got[0], expected[0])


@pytest.mark.parametrize("dtype,scale_type,batched", [
    (np.uint8, np.float32, False), (np.int8, np.float16, True), (np.uint8, np.float16, False),
])
def test_qlinear_matmul(pool, dtype, scale_type, batched):
    a = ints((2, 4, 9) if batched else (4, 9), dtype)
    b = ints((2, 9, 5) if batched else (9, 5), dtype)

    def scale(v: float) -> np.ndarray:
        return np.array([v], scale_type)

    zero = ints((1,), dtype)
    inputs = [a, scale(0.02), zero, b, scale(0.03), ints((1,), dtype), scale(0.5), ints((1,), dtype)]
    got, expected = run_node(pool, "QLinearMatMul", inputs, opset=21)
    np.testing.assert_array_equal(got[0], expected[0])

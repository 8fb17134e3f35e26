"""Elementwise kernels on the real Vulkan device, against ONNX's reference evaluator.

Each case is a one-node model run through ``vkpool.Session``. Tolerances: float32 rtol 1e-5
for exact arithmetic and 1e-4 (atol 1e-6) for transcendental functions; float16 rtol 2e-3
(the shaders compute in float32 and round once, the reference rounds after every step);
integer and bool outputs must match exactly.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from node_cases import run_node

RNG = np.random.default_rng(1234)


def assert_matches(got: list[np.ndarray], expected: list[np.ndarray], rtol: float = 1e-5,
                   atol: float = 0.0) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, g.dtype, e.shape, e.dtype)
        if e.dtype.kind == "f":
            if e.dtype == np.float16:
                rtol, atol = max(rtol, 2e-3), max(atol, 1e-3)
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(g, e)


def randn(*shape: int, dtype: Any = np.float32, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def randint(*shape: int, dtype: Any = np.int32, low: int = -20, high: int = 20) -> np.ndarray:
    return RNG.integers(low, high, size=shape).astype(dtype)


# -- unary ----------------------------------------------------------------------------------------

# (op, attributes, input scale): values up to 60 reach the overflow range of naive tanh/softplus
FLOAT_UNARY = [
    ("Relu", {}, 3), ("LeakyRelu", {"alpha": 0.2}, 3), ("Sigmoid", {}, 30), ("Tanh", {}, 60),
    ("Exp", {}, 3), ("Neg", {}, 3), ("Abs", {}, 3), ("Reciprocal", {}, 3), ("Floor", {}, 5),
    ("Ceil", {}, 5), ("Sign", {}, 3), ("Sin", {}, 3), ("Cos", {}, 3), ("Erf", {}, 2),
    ("Gelu", {}, 3), ("Gelu", {"approximate": "tanh"}, 3), ("Elu", {"alpha": 0.7}, 3), ("Selu", {}, 3),
    ("Celu", {"alpha": 1.5}, 3), ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}, 3), ("HardSwish", {}, 5),
    ("Softplus", {}, 60), ("Softsign", {}, 3), ("Mish", {}, 20), ("ThresholdedRelu", {"alpha": 0.5}, 3),
    ("Shrink", {"lambd": 0.7, "bias": 0.2}, 3), ("Swish", {"alpha": 1.3}, 5),
]


@pytest.mark.parametrize("op,attrs,scale", FLOAT_UNARY, ids=lambda v: str(v) if isinstance(v, str) else None)
def test_float_unary(pool, op, attrs, scale):
    x = randn(3, 5, 7, scale=scale)
    opset = 24 if op == "Swish" else 21
    got, expected = run_node(pool, op, [x], attrs, opset=opset)
    assert_matches(got, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("op", ["Sqrt", "Log"])
def test_positive_domain_unary(pool, op):
    got, expected = run_node(pool, op, [np.abs(randn(4, 9, scale=10)) + 1e-3])
    assert_matches(got, expected, rtol=1e-5, atol=1e-7)


def test_round_is_half_to_even(pool):
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 0.49, -0.51, 3.7], dtype=np.float32)
    got, expected = run_node(pool, "Round", [x])
    assert_matches(got, expected)
    np.testing.assert_array_equal(got[0][:6], [-2, -2, -0, 0, 2, 2])


def test_tanh_small_arguments_keep_relative_precision(pool):
    x = np.array([1e-6, -3e-5, 1e-3, 0.05, -0.06], dtype=np.float32)
    got, _ = run_node(pool, "Tanh", [x])
    np.testing.assert_allclose(got[0], np.tanh(x.astype(np.float64)), rtol=1e-6)


@pytest.mark.parametrize("op", ["Sigmoid", "Gelu", "Abs"])
def test_float16_unary(pool, op):
    got, expected = run_node(pool, op, [randn(6, 5, dtype=np.float16)])
    assert_matches(got, expected)


@pytest.mark.parametrize("dtype", [np.int8, np.int64])
@pytest.mark.parametrize("op", ["Abs", "Neg", "Sign", "Relu"])
def test_integer_unary(pool, op, dtype):
    got, expected = run_node(pool, op, [randint(4, 6, dtype=dtype)])
    assert_matches(got, expected)


def test_isnan_isinf_not(pool):
    x = np.array([1.0, np.nan, np.inf, -np.inf, 0.0, -3.0], dtype=np.float32)
    assert_matches(*run_node(pool, "IsNaN", [x]))
    for neg, pos in [(1, 1), (1, 0), (0, 1)]:
        got, expected = run_node(pool, "IsInf", [x], {"detect_negative": neg, "detect_positive": pos})
        assert_matches(got, expected)
    assert_matches(*run_node(pool, "Not", [RNG.random((3, 4)) > 0.5]))


# -- binary ---------------------------------------------------------------------------------------

ARITH_TYPES = [np.float32, np.float16, np.int64, np.int8, np.uint8, np.uint64]


@pytest.mark.parametrize("dtype", ARITH_TYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
def test_arithmetic_broadcast(pool, op, dtype):
    if np.dtype(dtype).kind == "f":
        a, b = randn(2, 3, 4, dtype=dtype), randn(3, 1, dtype=dtype) + np.asarray(3, dtype)
    else:
        low = 0 if np.dtype(dtype).kind == "u" else -100
        a, b = randint(2, 3, 4, dtype=dtype, low=low, high=100), randint(3, 1, dtype=dtype, low=1, high=9)
    assert_matches(*run_node(pool, op, [a, b]))


def test_integer_division_truncates_toward_zero(pool):
    a = np.array([7, -7, 7, -7, 0, -1], dtype=np.int64)
    b = np.array([2, 2, -2, -2, 3, 5], dtype=np.int64)
    got, expected = run_node(pool, "Div", [a, b])
    assert_matches(got, expected)
    np.testing.assert_array_equal(got[0], [3, -3, -3, 3, 0, 0])


@pytest.mark.parametrize("fmod,dtype", [
    (1, np.float32), (0, np.int32), (1, np.int32), (0, np.int64), (1, np.int64), (0, np.uint8),
])
def test_mod(pool, fmod, dtype):
    if np.dtype(dtype).kind == "f":
        a, b = randn(5, 6, scale=10), randn(6, scale=3) + 0.5
    else:
        low = 0 if np.dtype(dtype).kind == "u" else -50
        a, b = randint(5, 6, dtype=dtype, low=low, high=50), randint(6, dtype=dtype, low=1, high=9)
        if low < 0:
            b = b * np.where(np.arange(6) % 2 == 0, 1, -1).astype(dtype)
    got, expected = run_node(pool, "Mod", [a, b], {"fmod": fmod})
    assert_matches(got, expected, rtol=1e-5, atol=1e-5)


def test_float_mod_python_semantics(pool):
    a = np.array([-4.3, 7.2, 5.0, 4.3, -7.2, 8.0, -3.0, 3.0, 1.0], dtype=np.float32)
    b = np.array([2.1, -3.4, 8.0, -2.1, 3.4, 5.0, np.inf, np.inf, -np.inf], dtype=np.float32)
    got, expected = run_node(pool, "Mod", [a, b], {"fmod": 0})
    assert_matches(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base,exponent", [
    (np.float32, np.float32), (np.float32, np.int64), (np.int32, np.float32), (np.int64, np.int64),
    (np.float16, np.float16),
])
def test_pow(pool, base, exponent):
    if np.dtype(base).kind == "f":
        x = randn(3, 4, dtype=base, scale=2)
    else:
        x = randint(3, 4, dtype=base, low=-5, high=6)
    if np.dtype(exponent).kind == "f" and np.dtype(base).kind == "f":
        # integral exponents keep negative bases real; fractional ones need a positive base
        y = np.array([2, 3, -1, 0.5], dtype=exponent)
        x = np.where(np.arange(4) == 3, np.abs(x) + np.asarray(0.1, x.dtype), x).astype(base)
    elif np.dtype(exponent).kind == "f":
        y = np.array([0, 1, 2, 3], dtype=exponent)
    else:
        y = np.array([0, 1, 3, 5], dtype=exponent)
    assert_matches(*run_node(pool, "Pow", [x, y]), rtol=1e-5)


@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint16])
def test_comparisons(pool, op, dtype):
    a, b = randint(4, 5, dtype=dtype, low=0, high=4), randint(5, dtype=dtype, low=0, high=4)
    assert_matches(*run_node(pool, op, [a, b]))


def test_equal_on_bool(pool):
    assert_matches(*run_node(pool, "Equal", [RNG.random((3, 4)) > 0.5, RNG.random((4,)) > 0.5]))


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(pool, op):
    assert_matches(*run_node(pool, op, [RNG.random((2, 3, 4)) > 0.5, RNG.random((3, 1)) > 0.5]))


def test_prelu_broadcasts_the_slope(pool):
    x, slope = randn(2, 3, 4, 5), randn(3, 1, 1)
    assert_matches(*run_node(pool, "PRelu", [x, slope]))


# -- variadic, Clip, Where ------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_broadcast(pool, op):
    inputs = [randn(3, 1, 4), randn(2, 1, 1, 4), randn(3, 4), randn(1)]
    if op == "Mean":  # the reference evaluator's Mean accumulates into the first input's shape
        inputs = [randn(2, 3, 3, 4), *inputs]
    assert_matches(*run_node(pool, op, inputs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic_single_input(pool, op):
    assert_matches(*run_node(pool, op, [randn(5, 3)]))


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_variadic_integers(pool, op):
    assert_matches(*run_node(pool, op, [randint(3, 4, dtype=np.int64), randint(4, dtype=np.int64),
                                         randint(3, 1, dtype=np.int64)]))


def test_max_propagates_nan(pool):
    a = np.array([1.0, np.nan, 3.0], dtype=np.float32)
    b = np.array([np.nan, 2.0, 1.0], dtype=np.float32)
    got, _ = run_node(pool, "Max", [a, b])
    np.testing.assert_array_equal(np.isnan(got[0]), [True, True, False])


def test_clip_attributes_before_opset_11(pool):
    # Clip-6 (bounds as attributes) holds from opset 6 to 10; vkpool loads opsets from 7
    assert_matches(*run_node(pool, "Clip", [randn(4, 5, scale=3)], {"min": -0.5, "max": 1.25}, opset=7))


@pytest.mark.parametrize("constants", [(1, 2), (), (1,), (2,)])
def test_clip_bounds_as_constants_or_tensors(pool, constants):
    lo, hi = np.array(-0.5, dtype=np.float32), np.array(0.75, dtype=np.float32)
    got, expected = run_node(pool, "Clip", [randn(4, 5, scale=3), lo, hi], constants=constants)
    assert_matches(got, expected)


def test_clip_one_bound_and_integers(pool):
    x = randint(6, 7, dtype=np.int64, low=-100, high=100)
    assert_matches(*run_node(pool, "Clip", [x, None, np.array(10, dtype=np.int64)], constants=(2,)))
    assert_matches(*run_node(pool, "Clip", [x.astype(np.int8), np.array(-3, dtype=np.int8)]))


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.bool_, np.float16])
def test_where_broadcasts_all_three(pool, dtype):
    cond = RNG.random((2, 1, 4)) > 0.5
    x = randint(3, 4, dtype=np.int32).astype(dtype)
    y = randint(2, 3, 1, dtype=np.int32).astype(dtype)
    assert_matches(*run_node(pool, "Where", [cond, x, y]))

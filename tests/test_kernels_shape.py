"""Shape and data-movement kernels on the real Vulkan device, against ONNX's reference evaluator.

Each case is a one-node model run through ``vkpool.Session``; inputs that must be known at
load time (Reshape's shape, Slice's starts ...) are initializers. Data movement is exact: every
output must equal the reference bit for bit (float casts: rtol 1e-3 for float16 rounding).
"""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import vkpool
from node_cases import run_node
from vkpool.kernels.base import TensorInfo

RNG = np.random.default_rng(99)


def assert_exact(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, g.dtype, e.shape, e.dtype)
        np.testing.assert_array_equal(g, e)


def tensor(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    """Distinct values (so a misplaced element shows) of any element type."""
    values = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    if np.dtype(dtype) == np.bool_:
        return values % 3 == 0
    return (values % 120 - 7).astype(dtype) if np.dtype(dtype).kind != "u" else (values % 250).astype(dtype)


ALL_TYPES = [np.float32, np.float16, np.int64, np.int32, np.int8, np.uint8, np.bool_]
i64 = np.int64


# -- views ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape,allowzero", [
    ([0, -1], 0), ([-1], 0), ([2, 0, 2, 2], 0), ([4, 1, 6], 0), ([6, 0, 4], 1),
])
def test_reshape(pool, shape, allowzero):
    x = tensor(4, 3, 2) if not allowzero else tensor(6, 0, 4)
    got, expected = run_node(pool, "Reshape", [x, np.array(shape, dtype=i64)], {"allowzero": allowzero},
                             constants=(1,))
    assert_exact(got, expected)


@pytest.mark.parametrize("axis", [0, 1, 3, -1, -3])
def test_flatten(pool, axis):
    assert_exact(*run_node(pool, "Flatten", [tensor(2, 3, 2, 2, dtype=np.int64)], {"axis": axis}))


def test_squeeze_unsqueeze_attribute_and_input_forms(pool):
    x = tensor(1, 3, 1, 2)
    assert_exact(*run_node(pool, "Squeeze", [x], {"axes": [0, -2]}, opset=11))
    assert_exact(*run_node(pool, "Squeeze", [x, np.array([2], dtype=i64)], constants=(1,)))
    assert_exact(*run_node(pool, "Squeeze", [x]))
    assert_exact(*run_node(pool, "Unsqueeze", [x], {"axes": [0, 5]}, opset=11))
    assert_exact(*run_node(pool, "Unsqueeze", [x, np.array([-1, 1, 3], dtype=i64)], constants=(1,)))


def test_identity_and_dropout_outputs(pool):
    x = tensor(3, 4)
    assert_exact(*run_node(pool, "Identity", [x]))
    got, expected = run_node(pool, "Dropout", [x, np.array(0.3, dtype=np.float32)], num_outputs=2)
    assert_exact(got, expected)
    assert got[1].dtype == np.bool_ and got[1].all()
    training = np.array(True)
    got, expected = run_node(pool, "Dropout", [x, np.array(0.0, dtype=np.float32), training],
                             constants=(1, 2), num_outputs=2)
    assert_exact(got, expected)


# -- gathers and scatters ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_TYPES, ids=lambda d: np.dtype(d).name)
def test_transpose_element_types(pool, dtype):
    assert_exact(*run_node(pool, "Transpose", [tensor(2, 3, 4, dtype=dtype)], {"perm": [1, 2, 0]}))


@pytest.mark.parametrize("perm", [None, [0, 2, 1, 3, 5, 4], [5, 4, 3, 2, 1, 0], [2, 0, 4, 1, 5, 3]])
def test_transpose_rank_6(pool, perm):
    attrs = {} if perm is None else {"perm": perm}
    assert_exact(*run_node(pool, "Transpose", [tensor(2, 3, 1, 4, 2, 3)], attrs))


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_concat_axes(pool, axis):
    shapes = [[2, 3, 4], [2, 3, 4], [2, 3, 4]]
    for k, s in enumerate(shapes):
        s[axis] = k + 1
    inputs = [tensor(*s) + np.float32(100 * k) for k, s in enumerate(shapes)]
    assert_exact(*run_node(pool, "Concat", inputs, {"axis": axis}))


def test_concat_int64_with_empty_and_single_input(pool):
    a, empty, b = tensor(3, 2, dtype=i64), np.zeros((0, 2), dtype=i64), tensor(1, 2, dtype=i64)
    assert_exact(*run_node(pool, "Concat", [a, empty, b], {"axis": 0}))
    assert_exact(*run_node(pool, "Concat", [a], {"axis": 1}))


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([0, 1], [3, 4], None, None),
    ([1], [1000], [-1], [2]),
    ([-1, 20], [-1000, -1000], [0, 2], [-1, -3]),
    ([0, 0, 3], [-1, 3, 0], [0, 1, 2], [1, -1, -1]),
    ([-100, 2], [100, 2], [1, 0], [3, 1]),
])
def test_slice(pool, starts, ends, axes, steps):
    inputs = [tensor(5, 6, 7), np.array(starts, dtype=i64), np.array(ends, dtype=i64)]
    inputs += [None if axes is None else np.array(axes, dtype=i64),
               None if steps is None else np.array(steps, dtype=i64)]
    assert_exact(*run_node(pool, "Slice", inputs, constants=(1, 2, 3, 4)))


def test_slice_attributes_before_opset_10(pool):
    assert_exact(*run_node(pool, "Slice", [tensor(4, 5, dtype=np.uint8)],
                           {"starts": [1, -3], "ends": [3, 1000], "axes": [0, 1]}, opset=9))


@pytest.mark.parametrize("shape", [[3, 1, 4], [2, 1, 6], [1, 1, 1]])
def test_expand(pool, shape):
    x = tensor(3, 1, dtype=np.int32)
    assert_exact(*run_node(pool, "Expand", [x, np.array(shape, dtype=i64)], constants=(1,)))


@pytest.mark.parametrize("repeats", [[1, 1, 1], [2, 1, 3], [3, 2, 2], [1, 0, 2]])
def test_tile(pool, repeats):
    x = tensor(2, 3, 2, dtype=np.float16)
    assert_exact(*run_node(pool, "Tile", [x, np.array(repeats, dtype=i64)], constants=(1,)))


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("constant", [True, False])
def test_gather(pool, axis, constant):
    x = tensor(4, 5, 3)
    dim = x.shape[axis]
    indices = np.array([[0, dim - 1], [-1, -dim], [1, 1]], dtype=i64)
    got, expected = run_node(pool, "Gather", [x, indices], {"axis": axis}, constants=(1,) if constant else ())
    assert_exact(got, expected)


def test_gather_int32_indices_scalar_and_bool_data(pool):
    x = tensor(6, 2, dtype=np.bool_)
    assert_exact(*run_node(pool, "Gather", [x, np.array(-2, dtype=np.int32)]))
    assert_exact(*run_node(pool, "Gather", [tensor(6, dtype=i64), np.array([5, 0, -6], dtype=np.int32)]))


# -- conversions and constants ----------------------------------------------------------------------

CAST_TYPES = [np.float32, np.float16, np.int64, np.int32, np.int8, np.uint8, np.bool_]


@pytest.mark.parametrize("src,dst", list(itertools.product(CAST_TYPES, CAST_TYPES)),
                         ids=lambda d: np.dtype(d).name)
def test_cast(pool, src, dst):
    values = np.array([0, 1, -1, 2.75, -2.75, 100, 127, 0.5], dtype=np.float32)
    if np.dtype(src).kind in "ub":
        values = np.abs(values)
    x = values.astype(src).reshape(2, 4)
    to = helper.np_dtype_to_tensor_dtype(np.dtype(dst))
    got, expected = run_node(pool, "Cast", [x], {"to": to})
    if np.dtype(dst) == np.float16:
        np.testing.assert_allclose(got[0], expected[0], rtol=1e-3)
        assert got[0].dtype == np.float16
    else:
        assert_exact(got, expected)


def test_castlike_and_double_is_unsupported(pool):
    assert_exact(*run_node(pool, "CastLike", [tensor(3, 4), np.zeros(1, dtype=np.int64)]))
    with pytest.raises(vkpool.UnsupportedOp):
        run_node(pool, "Cast", [tensor(2, 2)], {"to": TensorProto.DOUBLE})


@pytest.mark.parametrize("start,limit,delta,dtype", [
    (0, 10, 3, np.int64), (10, 6, -3, np.int32), (1.5, 7.25, 0.5, np.float32), (3, 3, 1, np.int64),
])
def test_range(pool, start, limit, delta, dtype):
    inputs = [np.array(v, dtype=dtype) for v in (start, limit, delta)]
    assert_exact(*run_node(pool, "Range", inputs, constants=(0, 1, 2)))


@pytest.mark.parametrize("attrs", [
    {}, {"start": 1}, {"end": -1}, {"start": -2, "end": 10}, {"start": 3, "end": 1},
])
def test_shape_as_model_output(pool, attrs):
    assert_exact(*run_node(pool, "Shape", [tensor(2, 3, 4, 5)], attrs))


def test_size_constant_and_constant_of_shape(pool):
    assert_exact(*run_node(pool, "Size", [tensor(2, 3, 4)]))
    assert_exact(*run_node(pool, "Constant", [], {"value": numpy_helper.from_array(tensor(2, 3, dtype=i64))}))
    assert_exact(*run_node(pool, "Constant", [], {"value_floats": [1.5, -2.0]}))
    value = numpy_helper.from_array(np.array([7], dtype=np.int32))
    assert_exact(*run_node(pool, "ConstantOfShape", [np.array([3, 2], dtype=i64)], {"value": value},
                           constants=(0,)))


@pytest.mark.parametrize("op_type,attrs,inputs,constants", [
    ("Shape", {"start": 1}, {"x": TensorInfo((2, 1, 3, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 4, 1), np.float32)}, {}),
    ("Size", {}, {"x": TensorInfo((3, 0, 2), np.int8)}, {}),
    ("Constant", {"value": np.arange(40, dtype=np.int64).reshape(5, 8)}, {}, {}),
    ("Constant", {"value_float": 2.5}, {}, {}),
    ("ConstantOfShape", {"value": np.array([True])}, {}, {"shape": np.array([3, 5], dtype=np.int64)}),
    ("ConstantOfShape", {}, {}, {"shape": np.array([4], dtype=np.int64)}),
], ids=lambda v: v if isinstance(v, str) else None)
def test_values_known_at_load_time_written_by_dispatches(pool, op_type, attrs, inputs, constants):
    """The loader folds these ops; a chunk built without folding runs their own dispatches."""
    from vkpool.engine import VulkanChunk
    from vkpool.kernels.registry import create_op
    from vkpool.model import Node

    in_names = [*inputs, *constants]
    infos = [inputs[n] if n in inputs else TensorInfo(constants[n].shape, constants[n].dtype)
             for n in in_names]
    op = create_op(op_type, attrs, infos, {i: constants[n] for i, n in enumerate(in_names) if n in constants})
    expected = op.reference([None] * len(in_names))[0]
    tensors = {**dict(zip(in_names, infos)), "y": op.output_infos()[0]}
    node = Node("n", op_type, "", in_names, ["y"], attrs)
    chunk = VulkanChunk(pool.vulkan_members[0], [node], tensors, constants, list(inputs), ["y"], 21)
    try:
        feeds = {n: np.zeros(i.shape, i.dtype) for n, i in inputs.items()}
        got = chunk.run(feeds)["y"]
    finally:
        chunk.close()
    assert chunk.stats.dispatches >= 1
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)

"""Split on the real Vulkan device, against ONNX's reference evaluator: every way an opset
gives the parts (input, attribute, num_outputs with an uneven last part), exact results."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node

X = np.arange(2 * 7 * 3, dtype=np.float32).reshape(2, 7, 3)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8, np.float16])
def test_split_input_sizes(pool, dtype):
    x = X.astype(dtype)
    got, expected = run_node(pool, "Split", [x, np.array([2, 0, 5], np.int64)], {"axis": -2},
                             constants=(1,), num_outputs=3, opset=13)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        np.testing.assert_array_equal(g, e)


def test_split_attribute_sizes(pool):
    got, expected = run_node(pool, "Split", [X], {"axis": 2, "split": [1, 2]}, num_outputs=2, opset=11)
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("parts", [1, 3, 4])
def test_split_num_outputs_uneven(pool, parts):
    got, expected = run_node(pool, "Split", [X], {"axis": 1, "num_outputs": parts}, num_outputs=parts,
                             opset=18)
    assert [g.shape[1] for g in got] == [e.shape[1] for e in expected]
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)

"""Compress on the real Vulkan device, against ONNX's reference evaluator: along an axis (the
condition shorter than it, or all false) and over the flattened input; exact results."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node

X = np.arange(4 * 5 * 3, dtype=np.int64).reshape(4, 5, 3)


@pytest.mark.parametrize("cond,axis", [
    ([True, False, True, True, False], 1), ([False, True], -3), ([False, False, False], 2),
    ([True, False] * 20, None),
])
def test_compress(pool, cond, axis):
    attrs = {"axis": axis} if axis is not None else {}
    got, expected = run_node(pool, "Compress", [X, np.array(cond)], attrs, constants=(1,), opset=11)
    assert got[0].shape == expected[0].shape
    np.testing.assert_array_equal(got[0], expected[0])

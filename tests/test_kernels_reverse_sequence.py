"""ReverseSequence on the real Vulkan device, against ONNX's reference evaluator: batch on either
axis, lengths from 1 to the full time extent, trailing feature dimensions, a bfloat16 tensor
(moved as bytes); exact results."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from node_cases import run_node


@pytest.mark.parametrize("batch_axis,shape,dtype", [
    (1, (5, 4), np.float32), (0, (4, 5, 3), np.int64), (0, (4, 6), ml_dtypes.bfloat16),
])
def test_reverse_sequence(pool, batch_axis, shape, dtype):
    x = np.arange(np.prod(shape)).reshape(shape).astype(dtype)
    time = shape[1 - batch_axis]
    lens = np.array([1, time, 2, time - 1], np.int64)
    attrs = {"batch_axis": batch_axis, "time_axis": 1 - batch_axis}
    want = x.copy()
    for b, n in enumerate(lens):
        index = [slice(None)] * x.ndim
        index[batch_axis], index[1 - batch_axis] = b, slice(0, int(n))
        want[tuple(index)] = x[tuple(index)][::-1]
    got, _ = run_node(pool, "ReverseSequence", [x, lens], attrs, opset=28, expected=[want])
    assert got[0].dtype == want.dtype
    np.testing.assert_array_equal(got[0].view(np.uint8), want.view(np.uint8))

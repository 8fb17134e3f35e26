"""EyeLike on the real Vulkan device, against ONNX's reference evaluator: square and wide and tall
outputs, diagonals above and below, the input's type or the dtype attribute's; exact results."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from node_cases import run_node


@pytest.mark.parametrize("shape,k", [((4, 4), 0), ((3, 7), 2), ((6, 2), -3), ((2, 5), 9)])
@pytest.mark.parametrize("dtype,to", [(np.float32, None), (np.int32, np.float16), (np.float32, np.bool_)])
def test_eyelike(pool, shape, k, dtype, to):
    x = np.full(shape, 7, dtype=dtype)
    attrs = {"k": k} | ({"dtype": helper.np_dtype_to_tensor_dtype(np.dtype(to))} if to else {})
    got, expected = run_node(pool, "EyeLike", [x], attrs, opset=22)
    assert got[0].dtype == expected[0].dtype
    np.testing.assert_array_equal(got[0], expected[0])

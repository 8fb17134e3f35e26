"""CenterCropPad on the real Vulkan device, against ONNX's reference evaluator: crops and pads of
even and odd differences, on every axis or a chosen few; exact results."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node

X = np.arange(5 * 6 * 3, dtype=np.float32).reshape(5, 6, 3)


@pytest.mark.parametrize("shape,axes", [
    ([3, 9, 3], None), ([8, 2, 4], None), ([2, 7], [0, 1]), ([4, 5], [-1, -3]), ([5, 6, 3], None),
])
def test_center_crop_pad(pool, shape, axes):
    attrs = {"axes": axes} if axes is not None else {}
    got, expected = run_node(pool, "CenterCropPad", [X, np.array(shape, np.int64)], attrs, constants=(1,),
                             opset=18)
    assert got[0].shape == expected[0].shape
    np.testing.assert_array_equal(got[0], expected[0])

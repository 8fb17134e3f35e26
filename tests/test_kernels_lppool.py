"""LpPool on the real Vulkan device, against ONNX's reference evaluator: p 1, 2 and 3, strides,
pads, dilations and ceil_mode, 1-D to 3-D windows. Float32 rtol 1e-5 (p = 3 takes pow twice)."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node

RNG = np.random.default_rng(8)


# geometry and p are compiled into the shader: each case is a variant to compile
@pytest.mark.parametrize("shape,attrs,p", [
    ((1, 3, 9), {"kernel_shape": [3]}, 1),
    ((2, 2, 7, 6), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}, 2),
    ((2, 2, 7, 6), {"kernel_shape": [3, 2], "strides": [2, 1], "pads": [1, 0, 1, 1]}, 3),
    ((1, 2, 8, 8), {"kernel_shape": [2, 2], "dilations": [2, 2], "strides": [3, 3]}, 2),
    ((1, 1, 4, 5, 6), {"kernel_shape": [2, 3, 2], "auto_pad": "SAME_UPPER"}, 2),
])
def test_lppool(pool, shape, attrs, p):
    x = RNG.standard_normal(shape).astype(np.float32)
    got, expected = run_node(pool, "LpPool", [x], {**attrs, "p": p}, opset=22)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-6)


def test_lppool_ceil_mode_windows_norm_only_what_they_cover(pool):
    # ONNX's reference evaluator scales a partial window's mean by the full kernel size, which
    # counts the covered elements several times; the operator is the norm of what is covered
    x = RNG.standard_normal((1, 1, 3, 3)).astype(np.float32)
    expected = np.array([[[[np.linalg.norm(x[0, 0, r:r + 2, c:c + 2]) for c in (0, 2)] for r in (0, 2)]]],
                        np.float32)
    attrs = {"kernel_shape": [2, 2], "strides": [2, 2], "ceil_mode": 1, "p": 2}
    got, _ = run_node(pool, "LpPool", [x], attrs, opset=22, expected=[expected])
    np.testing.assert_allclose(got[0], expected, rtol=1e-5)

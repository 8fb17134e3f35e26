"""GridSample on the real Vulkan device, against ONNX's reference evaluator: every mode and
padding, both corner alignments, 2-D and 3-D inputs, grids reaching past [-1, 1] so that the
padding rules matter. Float32 rtol 1e-5, atol 1e-5 (cubic weights cancel)."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node
from vkpool.kernels.base import TensorInfo
from vkpool.kernels.ops.grid_sample import GridSample

RNG = np.random.default_rng(21)

# geometry, mode and padding are compiled into the shader: each case is a variant to compile
CASES = [
    ((2, 3, 5, 4), "nearest", "zeros", 0), ((1, 2, 4, 6), "nearest", "reflection", 1),
    ((2, 3, 5, 4), "linear", "zeros", 1), ((1, 2, 4, 6), "linear", "border", 0),
    ((1, 2, 4, 6), "linear", "reflection", 0), ((2, 1, 5, 5), "cubic", "zeros", 0),
    ((1, 2, 4, 6), "cubic", "border", 1), ((1, 2, 4, 6), "cubic", "reflection", 0),
    ((1, 2, 3, 4, 5), "nearest", "border", 0), ((1, 2, 3, 4, 5), "linear", "reflection", 1),
]


def grid_for(shape: tuple[int, ...]) -> np.ndarray:
    nd = len(shape) - 2
    out = (shape[0], *[3] * nd, nd)
    return RNG.uniform(-1.6, 1.6, size=out).astype(np.float32)


@pytest.mark.parametrize("shape,mode,padding,align", CASES)
def test_grid_sample(pool, shape, mode, padding, align):
    x = RNG.standard_normal(shape).astype(np.float32)
    grid = grid_for(shape)
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    got, expected = run_node(pool, "GridSample", [x, grid], attrs, opset=22)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,mode,padding,align", CASES)
def test_numpy_reference_matches_onnx(pool, shape, mode, padding, align):
    # the host member runs GridSample.reference: it must agree with ONNX's evaluator too
    x = RNG.standard_normal(shape).astype(np.float32)
    grid = grid_for(shape)
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    op = GridSample(attrs, [TensorInfo(x.shape, x.dtype), TensorInfo(grid.shape, grid.dtype)], opset=22)
    _, expected = run_node(pool, "GridSample", [x, grid], attrs, opset=22)
    np.testing.assert_allclose(op.reference([x, grid])[0], expected[0], rtol=1e-5, atol=1e-5)

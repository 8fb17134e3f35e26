"""GridSample and AffineGrid on the real Vulkan device, against ONNX's reference evaluator:
every mode and padding, both corner alignments, 2-D and 3-D inputs, grids reaching past [-1, 1]
so that the padding rules matter. Float32 rtol 1e-5, atol 1e-5 (cubic weights cancel)."""
from __future__ import annotations

import numpy as np
import pytest

from node_cases import run_node
from vkpool.kernels.base import TensorInfo
from vkpool.kernels.ops.affine_grid import AffineGrid
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


# a one-pixel axis with align_corners sits at -1; the reference evaluator gets there through 2/0
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("size", [(2, 3, 4, 5), (2, 1, 3, 1, 4), (1, 1, 1, 6)])
@pytest.mark.parametrize("align", [0, 1])
def test_affine_grid(pool, size, align):
    nd = len(size) - 2
    theta = RNG.standard_normal((size[0], nd, nd + 1)).astype(np.float32)
    shape = np.array(size, np.int64)
    got, expected = run_node(pool, "AffineGrid", [theta, shape], {"align_corners": align}, constants=(1,),
                             opset=20)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-6)
    infos = [TensorInfo(theta.shape, theta.dtype), TensorInfo(shape.shape, shape.dtype)]
    op = AffineGrid({"align_corners": align}, infos, {1: shape}, opset=20)
    np.testing.assert_allclose(op.reference([theta, shape])[0], expected[0], rtol=1e-5, atol=1e-6)

"""AffineGrid (``shaders/affine_grid.comp``): the sampling grid of 2-D or 3-D affine transforms,
for GridSample; float32 ``theta``, the ``size`` input known at load time."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, UnsupportedOp, groups_1d,
)

_F32 = np.dtype(np.float32)


class AffineGrid(Op):
    op_type = "AffineGrid"
    constant_inputs = (1,)

    def check(self) -> None:
        theta = self.input(0)
        if theta.dtype != _F32:
            raise UnsupportedOp(f"AffineGrid: element type {theta.dtype} has no kernel")
        size = [int(v) for v in np.asarray(self.constants[1]).reshape(-1)]
        self.nd = len(size) - 2
        if self.nd not in (2, 3) or theta.shape != (size[0], self.nd, self.nd + 1):
            raise OpError(f"AffineGrid: theta {theta.shape} does not fit size {size}")
        self.spatial = tuple(size[2:])
        self.align = int(bool(self.attr("align_corners", 0)))

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo((self.input(0).shape[0], *self.spatial, self.nd), _F32)]

    def _coordinates(self, size: int) -> np.ndarray:
        i = np.arange(size, dtype=np.float64)
        if self.align:
            return -1 + i * 2 / (size - 1) if size > 1 else np.full(1, -1.0)
        return -1 + (2 * i + 1) / size

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        theta = inputs[0]
        assert theta is not None
        axes = [self._coordinates(s) for s in self.spatial]  # (d,) h, w
        mesh = np.meshgrid(*axes, indexing="ij")
        homo = np.stack([*reversed(mesh), np.ones_like(mesh[0])], axis=-1)  # x, y[, z], 1
        grid = np.einsum("nrc,...c->n...r", theta.astype(np.float64), homo)
        return [grid.astype(np.float32)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        points = self.output_infos()[0].size // self.nd
        if points == 0:
            return []
        dims = (1,) * (3 - self.nd) + self.spatial
        defines = {"ND": self.nd, "OD": dims[0], "OH": dims[1], "OW": dims[2], "ALIGN": self.align}
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.outputs[0]), U32(points)]
        return [Dispatch("affine_grid", args, groups_1d(points, 256, ctx.caps), defines)]

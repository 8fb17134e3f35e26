"""Tile with constant repeats: the output viewed as ``[r0, d0, r1, d1, ...]`` is a gather with
stride 0 on every repeat dimension."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo, UnsupportedOp
from vkpool.kernels.ops.dtypes import word_defines
from vkpool.kernels.ops.movement import MAX_COPY_RANK, contiguous_strides, copy_rank, strided_copy


class Tile(Op):
    op_type = "Tile"
    constant_inputs = (1,)

    def check(self) -> None:
        x = self.input(0)
        word_defines(x.dtype)
        self.repeats = [int(v) for v in np.asarray(self.constants[1]).reshape(-1)]
        if len(self.repeats) != len(x.shape) or any(r < 0 for r in self.repeats):
            raise OpError(f"Tile: repeats {self.repeats} must be {len(x.shape)} non-negative values")
        shape, strides = self._view()
        if copy_rank(shape, strides) > MAX_COPY_RANK:
            raise UnsupportedOp(f"Tile: {x.shape} by {self.repeats} needs more than {MAX_COPY_RANK} "
                                "non-mergeable dimensions")

    def _view(self) -> tuple[list[int], list[int]]:
        x = self.input(0)
        shape: list[int] = []
        strides: list[int] = []
        for r, d, s in zip(self.repeats, x.shape, contiguous_strides(x.shape)):
            shape += [r, d]
            strides += [0, s]
        return shape, strides

    def output_infos(self) -> list[TensorInfo]:
        x = self.input(0)
        return [TensorInfo(tuple(r * d for r, d in zip(self.repeats, x.shape)), x.dtype)]

    def flops(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        return [np.tile(x, self.repeats)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        shape, strides = self._view()
        return strided_copy(ctx.inputs[0], ctx.outputs[0], shape, strides, self.input(0).dtype, ctx.caps)

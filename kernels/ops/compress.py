"""Compress (``shaders/compress.comp``): the slices along ``axis`` (of the flattened input when
there is none) whose condition is true. The condition fixes the output's extent, so it must be
known at load time; the shader reads it on the device."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from vkpool.kernels.base import (
    Dispatch, DispatchContext, Op, OpError, Ptr, TensorInfo, U32, check_serial, groups_1d,
)
from vkpool.kernels.ops.dtypes import BOOL, word_defines


class Compress(Op):
    op_type = "Compress"
    constant_inputs = (1,)

    def check(self) -> None:
        x, cond = self.input(0), self.input(1)
        word_defines(x.dtype)
        if cond.dtype != BOOL or len(cond.shape) != 1:
            raise OpError(f"Compress: the condition must be a 1-D bool tensor, got {cond.shape} {cond.dtype}")
        axis = self.attr("axis")
        rank = len(x.shape)
        if axis is None:
            self.axis, self.view = None, (1, x.size, 1)
        else:
            if not -rank <= int(axis) < rank:
                raise OpError(f"Compress: axis {axis} out of range for rank {rank}")
            self.axis = int(axis) % rank
            self.view = (math.prod(x.shape[:self.axis]), x.shape[self.axis],
                         math.prod(x.shape[self.axis + 1:]))
        values = np.asarray(self.constants[1]).reshape(-1)
        if values.size > self.view[1] and values[self.view[1]:].any():
            raise OpError("Compress: the condition selects past the end of the axis")
        self.kept = int(np.count_nonzero(values[:self.view[1]]))

    def output_infos(self) -> list[TensorInfo]:
        x = self.input(0)
        if self.axis is None:
            return [TensorInfo((self.kept,), x.dtype)]
        return [TensorInfo(x.shape[:self.axis] + (self.kept,) + x.shape[self.axis + 1:], x.dtype)]

    def flops(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x, cond = inputs[0], inputs[1]
        assert x is not None and cond is not None
        return [np.compress(cond, x, axis=self.axis)]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        n = self.output_infos()[0].size
        if n == 0:
            return []
        outer, d, inner = self.view
        check_serial(min(d, self.input(1).size), ctx.caps, f"Compress along {d} elements")
        args = [Ptr(ctx.inputs[0]), Ptr(ctx.inputs[1]), Ptr(ctx.outputs[0]), U32(n), U32(d), U32(self.kept),
                U32(inner), U32(self.input(1).size)]
        return [Dispatch("compress", args, groups_1d(n, 256, ctx.caps), word_defines(self.input(0).dtype))]

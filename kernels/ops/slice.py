"""Slice with constant starts/ends/axes/steps (inputs from opset 10, attributes before), any
step sign, as one strided gather."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from vkpool.kernels.base import Dispatch, DispatchContext, Op, OpError, TensorInfo
from vkpool.kernels.ops.dtypes import word_defines
from vkpool.kernels.ops.movement import contiguous_strides, strided_copy


class Slice(Op):
    op_type = "Slice"
    constant_inputs = (1, 2, 3, 4)

    def check(self) -> None:
        x = self.input(0)
        word_defines(x.dtype)
        rank = len(x.shape)
        if self.opset < 10:
            starts = list(self.attr("starts", []))
            ends = list(self.attr("ends", []))
            axes = list(self.attr("axes", range(len(starts))))
            steps = [1] * len(starts)
        else:
            starts = [int(v) for v in self._values(1)]
            ends = [int(v) for v in self._values(2)]
            axes = [int(v) for v in self._values(3)] if self.has_input(3) else list(range(len(starts)))
            steps = [int(v) for v in self._values(4)] if self.has_input(4) else [1] * len(starts)
        if not len(starts) == len(ends) == len(axes) == len(steps):
            raise OpError("Slice: starts, ends, axes and steps differ in length")
        # per axis: (first index, step, count); Python's slice.indices clamps as ONNX specifies
        self.ranges = [(0, 1, d) for d in x.shape]
        seen: set[int] = set()
        for start, end, axis, step in zip(starts, ends, axes, steps):
            if not -rank <= axis < rank:
                raise OpError(f"Slice: axis {axis} out of range for rank {rank}")
            axis %= rank
            if axis in seen:
                raise OpError(f"Slice: axis {axis} repeated")
            seen.add(axis)
            if step == 0:
                raise OpError("Slice: steps must not be 0")
            first, stop, stride = slice(start, end, step).indices(x.shape[axis])
            self.ranges[axis] = (first, stride, len(range(first, stop, stride)))

    def _values(self, pos: int) -> np.ndarray:
        return np.asarray(self.constants[pos]).reshape(-1)

    def output_infos(self) -> list[TensorInfo]:
        return [TensorInfo(tuple(c for _, _, c in self.ranges), self.input(0).dtype)]

    def flops(self) -> int:
        return 0

    def reference(self, inputs: Sequence[np.ndarray | None]) -> list[np.ndarray]:
        x = inputs[0]
        assert x is not None
        # a negative step that runs to index 0 stops "before 0": None, not -1
        index = tuple(slice(f, None if f + s * c < 0 else f + s * c, s) for f, s, c in self.ranges)
        return [np.ascontiguousarray(x[index])]

    def dispatches(self, ctx: DispatchContext) -> list[Dispatch]:
        x = self.input(0)
        strides = contiguous_strides(x.shape)
        base = sum(f * st for (f, _, _), st in zip(self.ranges, strides))
        return strided_copy(ctx.inputs[0], ctx.outputs[0], self.output_infos()[0].shape,
                            [s * st for (_, s, _), st in zip(self.ranges, strides)], x.dtype, ctx.caps,
                            base=base)
